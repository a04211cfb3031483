//! How `--publish-mode auto` sends a small claim (fewer than
//! [`AUTO_ATOMIC_MIN_ROWS`](crate::publisher::AUTO_ATOMIC_MIN_ROWS) rows, i.e. low load): pipelined
//! or as one atomic batch, whichever the broker has answered sooner, as timed by this relay.
//!
//! The two brokers handoff meets differ by a factor of several here. An R1 stream with the default
//! `sync_interval` stores a pipelined message in microseconds, so a claim of 15 rows is answered
//! about one round trip after it is sent; an atomic batch on R1 is staged in a file store of its own
//! (created and deleted per batch), which costs a few milliseconds whatever the broker's fsync
//! setting. With `sync_interval: always` every pipelined message waits for its own fsync behind
//! every other publisher's: 15 rows take 15 fsyncs, the atomic batch about four. Measured on this
//! machine at 10% load (docs/benchmarks.md, "Small claims as the broker answers them"): with
//! `always` small claims took 12-19 ms pipelined against about 4-6 ms as atomic batches, and the
//! end-to-end p50 halved when they went atomic; on the default broker a claim's publish takes about
//! a millisecond pipelined (session 21's step timings) and the end-to-end p50 rose from 3.5 to 5.9
//! ms with small claims forced atomic (session 22). How fast an fsync is matters too: on session
//! 18's quicker disk pipelined still won with `always`. No fixed rule is right for all of them, and
//! the relay cannot read the server's fsync setting.
//!
//! So it times them: every small claim published pipelined, from sending its first message to its
//! last PubAck, and every small claim committed as one atomic batch, from sending to the commit's
//! PubAck, each as a moving average. (The PubAcks of a pipelined claim do not say how long each
//! message took: the broker flushes its answers to a connection together, so they arrive about at
//! once however many fsyncs they waited for.) A small claim goes the way whose average is lower;
//! claims at one load hold about as many rows either way, so the averages compare like with like.
//! Pipelined is the start; once it has been timed, one small claim is sent atomic as a trial, and
//! from then on every [`PROBE_EVERY`]th small claim goes the way not preferred, to keep that
//! average current: the broker's settings and load change under a running relay. On the default
//! broker that costs the trial and one claim in [`PROBE_EVERY`] a few milliseconds.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One small claim in this many goes out the way not preferred, to refresh that way's average (a
/// probe costs that one claim the difference).
pub const PROBE_EVERY: u64 = 256;

/// At most one line per this long says that small claims changed how they go out (near the
/// break-even point the choice may go back and forth).
const CHANGE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Weight of a new sample in the moving averages: recent enough to follow a broker that changed,
/// smooth enough that one slow claim on a busy machine does not flip the choice.
const NEW_SAMPLE_WEIGHT: f64 = 0.125;

/// How a small claim is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmallClaim {
    Pipelined,
    Atomic,
}

/// The moving averages behind the choice, in seconds, and the bookkeeping of probes.
#[derive(Debug, Default, Clone, Copy)]
struct Estimates {
    /// From sending a small pipelined claim to its last PubAck.
    pipelined: Option<f64>,
    /// From sending a small atomic claim to the commit's PubAck.
    atomic: Option<f64>,
    /// Small claims decided, for the periodic probe.
    decided: u64,
    /// Whether the first atomic trial has been sent (it may not come back timed: a batch refused
    /// for a stored id, an error; then the probes try again).
    trial_sent: bool,
    /// Whether small claims go atomic (probes aside), to log when that changes.
    atomic_preferred: bool,
    last_logged: Option<Instant>,
}

impl Estimates {
    fn choose(&mut self, messages: usize) -> SmallClaim {
        self.decided += 1;
        let probe = self.decided.is_multiple_of(PROBE_EVERY);
        let Some(pipelined) = self.pipelined else {
            return SmallClaim::Pipelined;
        };
        let Some(atomic) = self.atomic else {
            let trial = !self.trial_sent || probe;
            self.trial_sent = true;
            return if trial { SmallClaim::Atomic } else { SmallClaim::Pipelined };
        };
        let atomic_pays = atomic < pipelined;
        tracing::debug!(messages, pipelined_ms = pipelined * 1e3, atomic_ms = atomic * 1e3, atomic_pays, "small claim");
        if atomic_pays != self.atomic_preferred {
            self.atomic_preferred = atomic_pays;
            if self.last_logged.is_none_or(|at| at.elapsed() >= CHANGE_LOG_INTERVAL) {
                self.last_logged = Some(Instant::now());
                tracing::info!(
                    small_claims = if atomic_pays { "atomic" } else { "pipelined" },
                    messages,
                    pipelined_ms = pipelined * 1e3,
                    atomic_ms = atomic * 1e3,
                    "publish mode auto: small claims change how they are published (average time to the last PubAck)"
                );
            }
        }
        if atomic_pays != probe { SmallClaim::Atomic } else { SmallClaim::Pipelined }
    }
}

fn fold(average: &mut Option<f64>, sample: Duration) {
    let sample = sample.as_secs_f64();
    *average = Some(match *average {
        None => sample,
        Some(old) => old + NEW_SAMPLE_WEIGHT * (sample - old),
    });
}

/// The choice for a relay process's small claims, shared by its workers.
#[derive(Debug, Default)]
pub struct SmallClaims {
    estimates: Mutex<Estimates>,
}

impl SmallClaims {
    /// How to publish a small claim of `messages` rows.
    pub fn choose(&self, messages: usize) -> SmallClaim {
        self.lock().choose(messages)
    }

    /// Records a small claim published pipelined whose every message was answered, `took` from
    /// sending to the last PubAck.
    pub fn pipelined(&self, took: Duration) {
        fold(&mut self.lock().pipelined, took);
    }

    /// Records a small claim committed as one atomic batch, `took` from sending to its PubAck.
    pub fn atomic(&self, took: Duration) {
        fold(&mut self.lock().atomic, took);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Estimates> {
        self.estimates.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1e3)
    }

    fn atomic_share(claims: &SmallClaims, decisions: u64) -> u64 {
        (0..decisions).filter(|_| claims.choose(15) == SmallClaim::Atomic).count() as u64
    }

    /// At most how many of `decisions` consecutive claims are probes.
    fn probes(decisions: u64) -> u64 {
        decisions.div_ceil(PROBE_EVERY)
    }

    /// A relay that has sent its trial and timed it at `atomic` ms, pipelined claims at `pipelined`.
    fn timed(pipelined: f64, atomic: f64) -> SmallClaims {
        let claims = SmallClaims::default();
        claims.pipelined(ms(pipelined));
        assert_eq!(claims.choose(15), SmallClaim::Atomic, "the trial");
        claims.atomic(ms(atomic));
        claims
    }

    #[test]
    fn small_claims_start_pipelined_and_try_atomic_once_when_pipelined_has_been_timed() {
        let claims = SmallClaims::default();
        assert_eq!(atomic_share(&claims, 1_000), 0, "nothing timed yet");
        claims.pipelined(ms(1.0));
        assert_eq!(claims.choose(15), SmallClaim::Atomic, "the trial");
        // The trial has not come back timed (refused for a stored id, say): no second trial but
        // at the probes, and no claim waits for one.
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&claims, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions), "{atomic} of {decisions} atomic");
    }

    #[test]
    fn a_broker_that_stores_in_microseconds_keeps_small_claims_pipelined_but_for_the_probes() {
        // The default sync_interval, as measured here: 1 ms pipelined, 4.5 ms as an atomic batch.
        let claims = timed(1.0, 4.5);
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&claims, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions), "{atomic} probes of {decisions}");
    }

    #[test]
    fn a_broker_that_fsyncs_each_message_gets_small_claims_as_atomic_batches_while_they_are_faster() {
        // sync_interval always: 17 ms pipelined (every message an fsync, queued behind the other
        // publishers'), 5 ms atomic.
        let claims = timed(17.0, 5.0);
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&claims, decisions);
        assert!(atomic < decisions && atomic >= decisions - probes(decisions), "{atomic} of {decisions} atomic");

        // Atomic commits become slow (a busy broker): small claims go back to pipelined, but for
        // the probes that keep timing atomic batches.
        for _ in 0..50 {
            claims.atomic(ms(30.0));
        }
        let atomic = atomic_share(&claims, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions), "{atomic} probes of {decisions}");
        // The broker recovers: the probes' fast commits bring small claims back to atomic.
        for _ in 0..50 {
            claims.atomic(ms(5.0));
        }
        assert!(atomic_share(&claims, decisions) >= decisions - probes(decisions));
    }

    #[test]
    fn the_averages_follow_a_broker_whose_fsync_setting_changed() {
        let claims = timed(17.0, 5.0);
        assert_eq!(claims.choose(15), SmallClaim::Atomic);
        // The probes see pipelined claims answered in a millisecond now: pipelined is faster.
        for _ in 0..50 {
            claims.pipelined(ms(1.0));
        }
        assert!(atomic_share(&claims, 1_000) <= probes(1_000));
    }

    #[test]
    fn one_slow_claim_does_not_flip_the_choice() {
        let claims = timed(1.0, 4.5);
        for _ in 0..50 {
            claims.pipelined(ms(1.0));
        }
        claims.pipelined(ms(20.0)); // one claim answered as by an fsyncing broker
        assert!(atomic_share(&claims, 1_000) <= probes(1_000), "only the probes go atomic");
    }
}
