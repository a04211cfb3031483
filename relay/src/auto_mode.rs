//! How `--publish-mode auto` sends a claim on a server with atomic batches: pipelined or as
//! atomic batches, whichever the broker has answered sooner, as timed by this relay, for small
//! claims (fewer than [`AUTO_ATOMIC_MIN_ROWS`] rows, i.e. low load) and for large ones apart.
//!
//! The two brokers handoff meets differ by a factor of several either way. An R1 stream with the
//! default `sync_interval` stores a pipelined message in microseconds, so a claim of 15 rows is
//! answered about one round trip after it is sent; an atomic batch on R1 is staged in a file store
//! of its own (created and deleted per batch), which costs a few milliseconds whatever the
//! broker's fsync setting, and on a full claim the staging costs the broker more CPU per message
//! than storing it directly (measured: 2 relay processes drained 0.78x-0.86x as fast in atomic
//! batches as pipelined, docs/benchmarks.md, sessions 24 and 28). With `sync_interval: always`
//! every pipelined message waits for its own fsync behind every other publisher's: 15 rows take
//! 15 fsyncs, the atomic batch about four, and a full claim of 1,000 rows drains about ten times
//! as fast in atomic batches. Measured on this machine at 10% load (docs/benchmarks.md, "Small
//! claims as the broker answers them"): with `always` small claims took 12-19 ms pipelined against
//! about 4-6 ms as atomic batches, and the end-to-end p50 halved when they went atomic. How fast
//! an fsync is matters too: on session 18's quicker disk pipelined still won small claims with
//! `always`. No fixed rule is right for all of them, and the relay cannot read the server's fsync
//! setting.
//!
//! So it times them: every claim published pipelined, from sending its first message to its last
//! PubAck, and every claim committed whole in atomic batches, from sending to the last commit's
//! PubAck (the atomic rest of a [`Way::PipelinedFirst`] claim is not timed),
//! each as a moving average per size class: seconds per claim for small claims (claims at one low
//! load hold about as many rows either way, and what a claim waits for is its latency), seconds
//! per row for large ones (their size varies with the backlog, and what matters is the rate). (The
//! PubAcks of a pipelined claim do not say how long each message took: the broker flushes its
//! answers to a connection together, so they arrive about at once however many fsyncs they waited
//! for.) A claim goes the way whose average is lower in its class. Each class starts the way that
//! costs least if it is the wrong one: small claims pipelined (a few milliseconds lost per claim
//! on a broker that fsyncs), large claims atomic (pipelined on such a broker would cost a full
//! claim a thousand fsyncs). Once that way has been timed, one claim of the class is sent the other
//! way as a trial, and from then on every [`PROBE_EVERY`]th small claim and every
//! [`LARGE_PROBE_EVERY`]th large one goes the way not preferred, to keep that average current: the
//! broker's settings and load change under a running relay. A large claim tries pipelined on its
//! first [`LARGE_TRIAL_ROWS`] rows only and sends the rest in atomic batches
//! ([`Way::PipelinedFirst`]): a hundred fsyncs on a broker that fsyncs each message, not a
//! thousand.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// In `--publish-mode auto`, claims of fewer rows than this are small: they are timed per claim,
/// larger ones per row. Measured (docs/benchmarks.md, session 12): at 10% load claims held about
/// 14 rows, and a full claim under a backlog holds the batch size (1,000 by default).
pub const AUTO_ATOMIC_MIN_ROWS: usize = 100;

/// One small claim in this many goes out the way not preferred, to refresh that way's average (a
/// probe costs that one claim the difference: a few milliseconds).
pub const PROBE_EVERY: u64 = 256;

/// One large claim in this many goes out the way not preferred. A pipelined probe on a broker that
/// fsyncs each message costs its claim [`LARGE_TRIAL_ROWS`] fsyncs (about 26 ms on this machine's
/// disk, against about 50 ms for a full claim in atomic batches): one claim in 256 keeps that
/// under half a percent of a drain.
pub const LARGE_PROBE_EVERY: u64 = 256;

/// At most one line per this long says that a class of claims changed how it goes out (near the
/// break-even point the choice may go back and forth).
const CHANGE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Weight of a new sample in the moving averages: recent enough to follow a broker that changed,
/// smooth enough that one slow claim on a busy machine does not flip the choice.
const NEW_SAMPLE_WEIGHT: f64 = 0.125;

/// Rows of a large claim sent pipelined when pipelined is tried or probed while large claims go
/// atomic ([`Way::PipelinedFirst`]): enough that the round trip is a small part of their time,
/// few enough that on a broker that fsyncs each message the trial costs a fraction of a full
/// claim's thousand fsyncs. At least [`AUTO_ATOMIC_MIN_ROWS`], so their timing is a large claim's.
pub const LARGE_TRIAL_ROWS: usize = 100;
const _: () = assert!(LARGE_TRIAL_ROWS >= AUTO_ATOMIC_MIN_ROWS);

/// How a claim is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    Pipelined,
    Atomic,
    /// The first `n` rows pipelined (timed as a pipelined claim of `n` rows), the rest in atomic
    /// batches: how a large claim tries pipelined while large claims go atomic.
    PipelinedFirst(usize),
}

impl Way {
    fn other(self) -> Self {
        match self {
            Self::Pipelined | Self::PipelinedFirst(_) => Self::Atomic,
            Self::Atomic => Self::Pipelined,
        }
    }

    /// The `way` label of `handoff_relay_claims_published_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Pipelined => "pipelined",
            Self::Atomic => "atomic",
            Self::PipelinedFirst(_) => "pipelined_first",
        }
    }
}

/// The two size classes of claims, timed apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Fewer than [`AUTO_ATOMIC_MIN_ROWS`] rows: timed per claim.
    Small,
    /// The rest: timed per row.
    Large,
}

impl Class {
    fn of(messages: usize) -> Self {
        if messages < AUTO_ATOMIC_MIN_ROWS { Self::Small } else { Self::Large }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Small => "small",
            Self::Large => "large",
        }
    }

    /// The way a class starts with, before both have been timed.
    fn start(self) -> Way {
        match self {
            Self::Small => Way::Pipelined,
            Self::Large => Way::Atomic,
        }
    }

    fn probe_every(self) -> u64 {
        match self {
            Self::Small => PROBE_EVERY,
            Self::Large => LARGE_PROBE_EVERY,
        }
    }

    /// What one claim of `messages` rows adds to the class's average.
    fn sample(self, messages: usize, took: Duration) -> f64 {
        match self {
            Self::Small => took.as_secs_f64(),
            Self::Large => took.as_secs_f64() / messages.max(1) as f64,
        }
    }
}

/// The moving averages behind one class's choice, in seconds (per claim or per row), and the
/// bookkeeping of probes.
#[derive(Debug, Clone, Copy)]
struct Estimates {
    class: Class,
    pipelined: Option<f64>,
    atomic: Option<f64>,
    /// Claims of this class decided, for the periodic probe.
    decided: u64,
    /// Whether the first trial of the other way has been sent (it may not come back timed: a
    /// batch refused for a stored id, an error; then the probes try again).
    trial_sent: bool,
    /// The way claims of this class go (probes aside), to log when that changes.
    preferred: Way,
    last_logged: Option<Instant>,
}

impl Estimates {
    fn new(class: Class) -> Self {
        Self {
            class,
            pipelined: None,
            atomic: None,
            decided: 0,
            trial_sent: false,
            preferred: class.start(),
            last_logged: None,
        }
    }

    fn average(&mut self, way: Way) -> &mut Option<f64> {
        match way {
            Way::Pipelined | Way::PipelinedFirst(_) => &mut self.pipelined,
            Way::Atomic => &mut self.atomic,
        }
    }

    /// `way` for a trial or probe of a claim of `messages` rows: a large claim tries pipelined on
    /// its first [`LARGE_TRIAL_ROWS`] rows only.
    fn tried(&self, way: Way, messages: usize) -> Way {
        match (self.class, way) {
            (Class::Large, Way::Pipelined) if messages > LARGE_TRIAL_ROWS => Way::PipelinedFirst(LARGE_TRIAL_ROWS),
            _ => way,
        }
    }

    fn choose(&mut self, messages: usize) -> Way {
        self.decided += 1;
        let probe = self.decided.is_multiple_of(self.class.probe_every());
        let start = self.class.start();
        let Some(started) = *self.average(start) else {
            return start;
        };
        let Some(other) = *self.average(start.other()) else {
            let trial = !self.trial_sent || probe;
            self.trial_sent = true;
            return if trial { self.tried(start.other(), messages) } else { start };
        };
        let preferred = if other < started { start.other() } else { start };
        let (pipelined, atomic) = (self.pipelined.unwrap_or_default(), self.atomic.unwrap_or_default());
        let class = self.class.name();
        tracing::debug!(class, messages, pipelined, atomic, preferred = preferred.label(), "claim");
        if preferred != self.preferred {
            self.preferred = preferred;
            if self.last_logged.is_none_or(|at| at.elapsed() >= CHANGE_LOG_INTERVAL) {
                self.last_logged = Some(Instant::now());
                let unit = match self.class {
                    Class::Small => "average seconds from sending a claim to its last PubAck",
                    Class::Large => "average seconds per row from sending a claim to its last PubAck",
                };
                tracing::info!(
                    claims = class,
                    published = preferred.label(),
                    messages,
                    pipelined,
                    atomic,
                    unit,
                    "publish mode auto: a class of claims changes how it is published"
                );
            }
        }
        if probe { self.tried(preferred.other(), messages) } else { preferred }
    }

    fn fold(&mut self, way: Way, messages: usize, took: Duration) {
        let sample = self.class.sample(messages, took);
        let average = self.average(way);
        *average = Some(match *average {
            None => sample,
            Some(old) => old + NEW_SAMPLE_WEIGHT * (sample - old),
        });
    }
}

/// The choice for a relay process's claims, shared by its workers.
#[derive(Debug)]
pub struct AutoMode {
    small: Mutex<Estimates>,
    large: Mutex<Estimates>,
}

impl Default for AutoMode {
    fn default() -> Self {
        Self { small: Mutex::new(Estimates::new(Class::Small)), large: Mutex::new(Estimates::new(Class::Large)) }
    }
}

impl AutoMode {
    /// How to publish a claim of `messages` rows.
    pub fn choose(&self, messages: usize) -> Way {
        self.lock(messages).choose(messages)
    }

    /// Records a claim of `messages` rows published `way` whose every message was stored (an
    /// atomic claim: committed without a fallback), `took` from sending to the last PubAck.
    pub fn timed(&self, way: Way, messages: usize, took: Duration) {
        self.lock(messages).fold(way, messages, took);
    }

    fn lock(&self, messages: usize) -> std::sync::MutexGuard<'_, Estimates> {
        let estimates = match Class::of(messages) {
            Class::Small => &self.small,
            Class::Large => &self.large,
        };
        estimates.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: usize = 15;
    const FULL: usize = 1_000;

    fn ms(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1e3)
    }

    fn atomic_share(auto: &AutoMode, messages: usize, decisions: u64) -> u64 {
        (0..decisions).filter(|_| auto.choose(messages) == Way::Atomic).count() as u64
    }

    #[test]
    fn only_a_large_claim_larger_than_the_trial_is_tried_on_its_first_rows() {
        let auto = AutoMode::default();
        auto.timed(Way::Atomic, LARGE_TRIAL_ROWS, ms(10.0));
        assert_eq!(auto.choose(LARGE_TRIAL_ROWS), Way::Pipelined, "a claim of the trial's size is tried whole");
        let auto = AutoMode::default();
        auto.timed(Way::Pipelined, SMALL, ms(1.0));
        assert_eq!(auto.choose(SMALL), Way::Atomic, "small claims try atomic whole");
    }

    #[test]
    fn while_full_claims_go_pipelined_their_atomic_probes_are_whole_claims() {
        let auto = timed_large(45.0, 35.0);
        let ways: Vec<Way> = (0..2 * LARGE_PROBE_EVERY).map(|_| auto.choose(FULL)).collect();
        assert!(
            ways.iter().all(|w| matches!(w, Way::Pipelined | Way::Atomic)),
            "{:?}",
            ways.iter().find(|w| matches!(w, Way::PipelinedFirst(_)))
        );
    }

    /// At most how many of `decisions` consecutive claims of a class are probes.
    fn probes(decisions: u64, every: u64) -> u64 {
        decisions.div_ceil(every)
    }

    /// A relay whose small claims have been timed at `pipelined` and (the trial) `atomic` ms.
    fn timed_small(pipelined: f64, atomic: f64) -> AutoMode {
        let auto = AutoMode::default();
        auto.timed(Way::Pipelined, SMALL, ms(pipelined));
        assert_eq!(auto.choose(SMALL), Way::Atomic, "the trial");
        auto.timed(Way::Atomic, SMALL, ms(atomic));
        auto
    }

    /// A relay whose full claims have been timed at `atomic` and (the trial) `pipelined` ms.
    /// (The trial sends [`LARGE_TRIAL_ROWS`] rows pipelined; `pipelined` is for a full claim, so
    /// the trial is timed at that rate.)
    fn timed_large(atomic: f64, pipelined: f64) -> AutoMode {
        let auto = AutoMode::default();
        auto.timed(Way::Atomic, FULL, ms(atomic));
        assert_eq!(auto.choose(FULL), Way::PipelinedFirst(LARGE_TRIAL_ROWS), "the trial");
        auto.timed(Way::Pipelined, LARGE_TRIAL_ROWS, ms(pipelined * LARGE_TRIAL_ROWS as f64 / FULL as f64));
        auto
    }

    #[test]
    fn small_claims_start_pipelined_and_try_atomic_once_when_pipelined_has_been_timed() {
        let auto = AutoMode::default();
        assert_eq!(atomic_share(&auto, SMALL, 1_000), 0, "nothing timed yet");
        auto.timed(Way::Pipelined, SMALL, ms(1.0));
        assert_eq!(auto.choose(SMALL), Way::Atomic, "the trial");
        // The trial has not come back timed (refused for a stored id, say): no second trial but
        // at the probes, and no claim waits for one.
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&auto, SMALL, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions, PROBE_EVERY), "{atomic} of {decisions} atomic");
    }

    #[test]
    fn a_broker_that_stores_in_microseconds_keeps_small_claims_pipelined_but_for_the_probes() {
        // The default sync_interval, as measured here: 1 ms pipelined, 4.5 ms as an atomic batch.
        let auto = timed_small(1.0, 4.5);
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&auto, SMALL, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions, PROBE_EVERY), "{atomic} probes of {decisions}");
    }

    #[test]
    fn a_broker_that_fsyncs_each_message_gets_small_claims_as_atomic_batches_while_they_are_faster() {
        // sync_interval always: 17 ms pipelined (every message an fsync, queued behind the other
        // publishers'), 5 ms atomic.
        let auto = timed_small(17.0, 5.0);
        let decisions = 10 * PROBE_EVERY;
        let atomic = atomic_share(&auto, SMALL, decisions);
        let most = decisions - probes(decisions, PROBE_EVERY);
        assert!(atomic < decisions && atomic >= most, "{atomic} of {decisions} atomic");

        // Atomic commits become slow (a busy broker): small claims go back to pipelined, but for
        // the probes that keep timing atomic batches.
        for _ in 0..50 {
            auto.timed(Way::Atomic, SMALL, ms(30.0));
        }
        let atomic = atomic_share(&auto, SMALL, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions, PROBE_EVERY), "{atomic} probes of {decisions}");
        // The broker recovers: the probes' fast commits bring small claims back to atomic.
        for _ in 0..50 {
            auto.timed(Way::Atomic, SMALL, ms(5.0));
        }
        assert!(atomic_share(&auto, SMALL, decisions) >= most);
    }

    #[test]
    fn the_averages_follow_a_broker_whose_fsync_setting_changed() {
        let auto = timed_small(17.0, 5.0);
        assert_eq!(auto.choose(SMALL), Way::Atomic);
        // The probes see pipelined claims answered in a millisecond now: pipelined is faster.
        for _ in 0..50 {
            auto.timed(Way::Pipelined, SMALL, ms(1.0));
        }
        assert!(atomic_share(&auto, SMALL, 1_000) <= probes(1_000, PROBE_EVERY));
    }

    #[test]
    fn one_slow_claim_does_not_flip_the_choice() {
        let auto = timed_small(1.0, 4.5);
        for _ in 0..50 {
            auto.timed(Way::Pipelined, SMALL, ms(1.0));
        }
        auto.timed(Way::Pipelined, SMALL, ms(20.0)); // one claim answered as by an fsyncing broker
        assert!(atomic_share(&auto, SMALL, 1_000) <= probes(1_000, PROBE_EVERY), "only the probes go atomic");
    }

    #[test]
    fn large_claims_start_atomic_and_try_pipelined_once_when_atomic_has_been_timed() {
        let auto = AutoMode::default();
        assert_eq!(atomic_share(&auto, FULL, 1_000), 1_000, "nothing timed yet");
        // Small claims' timings say nothing about large ones, and the other way round.
        auto.timed(Way::Pipelined, SMALL, ms(1.0));
        auto.timed(Way::Atomic, SMALL, ms(4.5));
        assert_eq!(atomic_share(&auto, FULL, 1_000), 1_000, "large claims not timed yet");
        auto.timed(Way::Atomic, FULL, ms(45.0));
        assert_eq!(auto.choose(FULL), Way::PipelinedFirst(LARGE_TRIAL_ROWS), "the trial, on the first rows only");
        let decisions = 4 * LARGE_PROBE_EVERY;
        let pipelined = decisions - atomic_share(&auto, FULL, decisions);
        assert!(
            pipelined > 0 && pipelined <= probes(decisions, LARGE_PROBE_EVERY),
            "{pipelined} of {decisions} pipelined"
        );
    }

    #[test]
    fn a_broker_that_stores_in_microseconds_gets_full_claims_pipelined_but_for_the_probes() {
        // The default sync_interval, as measured here: a full claim 35 ms pipelined, 45 ms atomic.
        let auto = timed_large(45.0, 35.0);
        let decisions = 4 * LARGE_PROBE_EVERY;
        let atomic = atomic_share(&auto, FULL, decisions);
        assert!(atomic > 0 && atomic <= probes(decisions, LARGE_PROBE_EVERY), "{atomic} probes of {decisions}");
        // Small claims are decided on their own timings: nothing timed, pipelined.
        assert_eq!(auto.choose(SMALL), Way::Pipelined);
    }

    #[test]
    fn a_broker_that_fsyncs_each_message_keeps_full_claims_atomic_and_claims_of_any_size_compare_per_row() {
        // sync_interval always: 50 ms atomic against a quarter of a second pipelined.
        let auto = timed_large(50.0, 270.0);
        let decisions = 4 * LARGE_PROBE_EVERY;
        let atomic = atomic_share(&auto, FULL, decisions);
        assert!(atomic >= decisions - probes(decisions, LARGE_PROBE_EVERY), "{atomic} of {decisions} atomic");
        // Per row, a claim of 200 rows pipelined in 20 ms (0.1 ms a row) is slower than 1,000
        // atomic in 50 ms (0.05 ms a row), though it took less time in all: still atomic.
        for _ in 0..50 {
            auto.timed(Way::Pipelined, 200, ms(20.0));
        }
        assert!(atomic_share(&auto, 200, 1_000) >= 1_000 - probes(1_000, LARGE_PROBE_EVERY));
        // Pipelined at 0.02 ms a row (the broker stopped fsyncing each message): pipelined.
        for _ in 0..50 {
            auto.timed(Way::Pipelined, FULL, ms(20.0));
        }
        assert!(atomic_share(&auto, FULL, 1_000) <= probes(1_000, LARGE_PROBE_EVERY));
    }
}
