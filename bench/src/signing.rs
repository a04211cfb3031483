//! What a message signature costs: the relay's encoding with and without signing, and the
//! consumer's opening with and without verification, in this process on one core (no I/O), so the
//! difference is the signature's own CPU time per message.

use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::Bytes;
use handoff_shared::Envelope;
use handoff_shared::envelope::SCHEMA_VERSION;
use handoff_shared::signing::{SignaturePolicy, SigningKey};

use crate::measure::Sample;
use crate::workload;

/// Envelopes per measurement: enough that one run takes a good fraction of a second.
pub const MESSAGES: i64 = 100_000;

fn sample(items: u64, elapsed: Duration) -> Sample {
    Sample { items, elapsed, cpu_s: Default::default(), count: Default::default(), peak_rss_mib: Default::default() }
}

/// The envelopes of one measurement, built before any clock starts.
pub fn envelopes(n: i64) -> Result<Vec<Envelope>> {
    (1..=n).map(|i| workload::envelope_value("sig", i)).collect()
}

/// Encodes every envelope, signed with `key` or unsigned.
pub fn encode(envelopes: &[Envelope], key: Option<&SigningKey>) -> (Sample, Vec<Bytes>) {
    let started = Instant::now();
    let bodies: Vec<Bytes> = envelopes.iter().map(|e| e.encode_signed(SCHEMA_VERSION, key)).collect();
    (sample(bodies.len() as u64, started.elapsed()), bodies)
}

/// Opens every body under `policy`; fails if any is refused.
pub fn open(envelopes: &[Envelope], bodies: &[Bytes], policy: &SignaturePolicy) -> Result<Sample> {
    let started = Instant::now();
    for (envelope, body) in envelopes.iter().zip(bodies) {
        Envelope::open(body, Some(envelope.key.as_str()), SCHEMA_VERSION, policy)?;
    }
    Ok(sample(bodies.len() as u64, started.elapsed()))
}
