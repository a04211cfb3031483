//! Log lines an operator can live with: errors with their whole cause chain, and one warning when
//! an outage starts and one when it ends (with what it cost) instead of one per failed row.

use std::error::Error;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `outer: cause: root cause`, the whole `source()` chain of `error` on one line.
pub fn error_chain(error: &(dyn Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Some errors repeat their source in their own message; say each thing once.
        if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line
}

/// Tracks one kind of outage (publishing, the batch transaction, CRM calls) across every loop of a
/// process: the first failure logs one WARN with its cause, later failures only count, and the
/// first success after them logs one WARN saying how long it lasted and what it cost.
#[derive(Debug)]
pub struct Outage {
    what: &'static str,
    state: Mutex<Option<Ongoing>>,
}

#[derive(Debug, Clone, Copy)]
struct Ongoing {
    since: Instant,
    failures: u64,
    affected: u64,
}

/// What an outage cost, reported when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutageCost {
    pub lasted: Duration,
    /// Failed operations (batches, publishes, calls) during it.
    pub failures: u64,
    /// Items (rows, messages) those failures touched.
    pub affected: u64,
}

impl Outage {
    pub const fn new(what: &'static str) -> Self {
        Self { what, state: Mutex::new(None) }
    }

    /// A failure touching `affected` items. Returns true when it starts an outage (and was logged).
    pub fn failed(&self, cause: &str, affected: u64) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.as_mut() {
            Some(ongoing) => {
                ongoing.failures += 1;
                ongoing.affected += affected;
                false
            }
            None => {
                *state = Some(Ongoing { since: Instant::now(), failures: 1, affected });
                tracing::warn!(
                    outage = self.what,
                    error = cause,
                    "{} failing; further failures are counted, not logged, until it recovers",
                    self.what
                );
                true
            }
        }
    }

    /// A success. Ends an ongoing outage (logging what it cost) and returns its cost.
    pub fn succeeded(&self) -> Option<OutageCost> {
        let ended = self.state.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        let cost = OutageCost { lasted: ended.since.elapsed(), failures: ended.failures, affected: ended.affected };
        tracing::warn!(
            outage = self.what,
            lasted_s = cost.lasted.as_secs_f64(),
            failures = cost.failures,
            affected = cost.affected,
            "{} recovered",
            self.what
        );
        Some(cost)
    }

    /// Whether an outage is ongoing.
    pub fn ongoing(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("relay batch failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn the_chain_names_every_cause_once() {
        let error = Outer(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"));
        assert_eq!(error_chain(&error), "relay batch failed: connection refused");
        let wrapped = anyhow::Error::from(error).context("claiming rows");
        let dyn_error: &(dyn Error + 'static) = wrapped.as_ref();
        assert_eq!(error_chain(dyn_error), "claiming rows: relay batch failed: connection refused");
    }

    #[test]
    fn an_outage_is_reported_once_at_its_start_and_once_at_its_end() {
        let outage = Outage::new("publishing");
        assert_eq!(outage.succeeded(), None, "no outage, nothing to report");
        assert!(outage.failed("timed out", 1000));
        assert!(!outage.failed("timed out", 1000));
        assert!(!outage.failed("timed out", 500));
        assert!(outage.ongoing());
        let cost = outage.succeeded().unwrap();
        assert_eq!((cost.failures, cost.affected), (3, 2500));
        assert!(!outage.ongoing());
        assert_eq!(outage.succeeded(), None);
    }
}
