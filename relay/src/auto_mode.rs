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
//! PubAck (the atomic rest of a [`Way::PipelinedFirst`] claim is not timed), each as an average
//! per size class: seconds per claim for small claims (claims at one low load hold about as many
//! rows either way, and what a claim waits for is its latency), seconds per row for large ones
//! (their size varies with the backlog, and what matters is the rate). The first samples of a way
//! count equally, later ones as a moving average. (The PubAcks of a pipelined claim do not say how
//! long each message took: the broker flushes its answers to a connection together, so they arrive
//! about at once however many fsyncs they waited for.) A claim goes the way whose average is lower
//! in its class. Each class starts the way that costs least if it is the wrong one: small claims
//! pipelined (a few milliseconds lost per claim on a broker that fsyncs), large claims atomic
//! (pipelined on such a broker would cost a full claim a thousand fsyncs). Once that way has been
//! timed, one claim of the class is sent the other way as a trial, and from then on every
//! [`PROBE_EVERY`]th small claim and every [`LARGE_PROBE_EVERY`]th large one goes the way not
//! preferred, to keep that average current: the broker's settings and load change under a running
//! relay.
//!
//! While large claims go atomic, pipelined is tried in two steps. A screen sends a claim's first
//! [`LARGE_TRIAL_ROWS`] rows pipelined and the rest in atomic batches ([`Way::PipelinedFirst`]):
//! on a broker that fsyncs each message that costs a hundred fsyncs, not a thousand, and comes
//! out several times slower per row than atomic. It is not compared with full claims as it is: a
//! hundred rows carry a whole round trip, which per row is ten times what it is in a full claim
//! (measured on the default broker: screens 13-24 µs per row against 17-28 µs for full atomic
//! claims, so one screen left large claims atomic although whole pipelined claims drain faster).
//! The screen's rows go out in [`SCREEN_PARTS`] parts, one after the other's PubAcks, and the
//! faster part counts: a broker busy for a moment with another relay's atomic batch slows one part
//! (such pauses made a third of one-part screens come out 2-6 times slower per row than atomic on
//! the default broker), a broker that fsyncs each message slows every part.
//! A screen within [`LARGE_SCREEN_MARGIN`] times the atomic average is followed by
//! [`LARGE_WHOLE_TRIALS`] whole claims sent pipelined, and those decide: the two ways are compared
//! on whole claims only. A screen that passes on a broker where whole pipelined claims are slower
//! costs those few claims about the margin's factor each, once per probe.

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

/// A screen ([`Way::PipelinedFirst`]) passes when its seconds per row are at most this many times
/// the atomic average of large claims: the round trip of a hundred rows is up to about half their
/// time on a broker that stores in microseconds (screens 13-24 µs per row against 17-28 µs for full
/// atomic claims, docs/benchmarks.md), while on a broker that fsyncs each message they come out
/// five times slower than atomic or more.
pub const LARGE_SCREEN_MARGIN: f64 = 2.0;

/// A screen's rows go out pipelined in this many parts, each once the one before has its
/// PubAcks, and the fastest part is its time. Measured with one part (docs/benchmarks.md): of 12
/// relay processes draining a backlog two at a time on the default broker, 4 screened 43-125 µs
/// per row against the others' 11-30, the broker busy with the other process's atomic batch of a
/// thousand rows, and stayed atomic. Such a pause slows one part; a broker that fsyncs each
/// message slows every part. Each part carries a round trip of its own.
pub const SCREEN_PARTS: usize = 2;

/// Whole large claims sent pipelined after a screen passed: their average against atomic's
/// decides. More than one, so that one claim slowed by a busy machine does not decide alone.
pub const LARGE_WHOLE_TRIALS: u32 = 2;

/// At most one line per this long says that a class of claims changed how it goes out (near the
/// break-even point the choice may go back and forth).
const CHANGE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Weight of a new sample in a way's average from its eighth sample on (the first ones count
/// equally, as a mean): recent enough to follow a broker that changed, smooth enough that one slow
/// claim on a busy machine does not flip the choice.
const NEW_SAMPLE_WEIGHT: f64 = 0.125;

/// Rows of a large claim sent pipelined in a screen ([`Way::PipelinedFirst`]): few enough that on
/// a broker that fsyncs each message the screen costs a tenth of a full claim's thousand fsyncs,
/// enough that the round trips of its [`SCREEN_PARTS`] parts do not hide the rate within
/// [`LARGE_SCREEN_MARGIN`]. A claim of this many rows or fewer is tried whole.
pub const LARGE_TRIAL_ROWS: usize = 100;

/// How a claim is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    Pipelined,
    Atomic,
    /// The first `n` rows pipelined, the rest in atomic batches: the screen of pipelined while
    /// large claims go atomic (its first `n` rows are timed as a screen, not as a pipelined claim).
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

/// An average of seconds (per claim or per row): the mean of the first samples, then a moving
/// average weighted [`NEW_SAMPLE_WEIGHT`].
#[derive(Debug, Clone, Copy)]
struct Average {
    seconds: f64,
    samples: u64,
}

impl Average {
    fn fold(average: &mut Option<Self>, sample: f64) {
        *average = Some(match *average {
            None => Self { seconds: sample, samples: 1 },
            Some(Self { seconds, samples }) => {
                let weight = (1.0 / (samples + 1) as f64).max(NEW_SAMPLE_WEIGHT);
                Self { seconds: seconds + weight * (sample - seconds), samples: samples + 1 }
            }
        });
    }
}

/// The averages behind one class's choice, in seconds (per claim or per row), and the
/// bookkeeping of probes.
#[derive(Debug, Clone, Copy)]
struct Estimates {
    class: Class,
    pipelined: Option<Average>,
    atomic: Option<Average>,
    /// Whole claims still to send pipelined after a screen passed.
    whole_trials_due: u32,
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
            whole_trials_due: 0,
            decided: 0,
            trial_sent: false,
            preferred: class.start(),
            last_logged: None,
        }
    }

    fn average(&mut self, way: Way) -> &mut Option<Average> {
        match way {
            Way::Pipelined | Way::PipelinedFirst(_) => &mut self.pipelined,
            Way::Atomic => &mut self.atomic,
        }
    }

    fn seconds(&mut self, way: Way) -> Option<f64> {
        self.average(way).map(|a| a.seconds)
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
        let Some(started) = self.seconds(start) else {
            return start;
        };
        if self.whole_trials_due > 0 {
            self.whole_trials_due -= 1;
            return Way::Pipelined;
        }
        let Some(other) = self.seconds(start.other()) else {
            let trial = !self.trial_sent || probe;
            self.trial_sent = true;
            return if trial { self.tried(start.other(), messages) } else { start };
        };
        let preferred = if other < started { start.other() } else { start };
        let (pipelined, atomic) = if start == Way::Atomic { (other, started) } else { (started, other) };
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
        if let Way::PipelinedFirst(_) = way {
            // A screen: it decides whether whole claims try pipelined, not how claims go.
            let atomic = self.seconds(Way::Atomic);
            let passed = atomic.is_some_and(|atomic| sample <= LARGE_SCREEN_MARGIN * atomic);
            if passed {
                self.whole_trials_due = LARGE_WHOLE_TRIALS;
            }
            let class = self.class.name();
            tracing::debug!(
                class,
                messages,
                pipelined = sample,
                atomic,
                passed,
                "publish mode auto: screen of pipelined"
            );
            return;
        }
        Average::fold(self.average(way), sample);
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
        self.estimates(Class::of(messages)).choose(messages)
    }

    /// Records a claim of `messages` rows published `way` whose every message was stored (an
    /// atomic claim: committed without a fallback), `took` from sending to the last PubAck; for
    /// [`Way::PipelinedFirst`], its pipelined first `messages` rows.
    pub fn timed(&self, way: Way, messages: usize, took: Duration) {
        // A screen's part may hold fewer rows than a large claim; a screen is always a large one's.
        let class = if let Way::PipelinedFirst(_) = way { Class::Large } else { Class::of(messages) };
        self.estimates(class).fold(way, messages, took);
    }

    fn estimates(&self, class: Class) -> std::sync::MutexGuard<'_, Estimates> {
        let estimates = match class {
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

    /// What a screen of [`LARGE_TRIAL_ROWS`] rows adds to their time at a full claim's rate: one
    /// round trip, in ms.
    const ROUND_TRIP: f64 = 1.0;

    /// A relay whose full claims have been timed at `atomic` ms and screened at the rate of
    /// `pipelined` ms per full claim (plus a round trip).
    fn screened_large(atomic: f64, pipelined: f64) -> AutoMode {
        let auto = AutoMode::default();
        auto.timed(Way::Atomic, FULL, ms(atomic));
        let screen = Way::PipelinedFirst(LARGE_TRIAL_ROWS);
        assert_eq!(auto.choose(FULL), screen, "the screen");
        auto.timed(screen, LARGE_TRIAL_ROWS, ms(pipelined * LARGE_TRIAL_ROWS as f64 / FULL as f64 + ROUND_TRIP));
        auto
    }

    /// A relay whose full claims have been timed at `atomic` ms, screened, and then timed whole at
    /// `pipelined` ms in the whole trials that follow a screen within the margin.
    fn timed_large(atomic: f64, pipelined: f64) -> AutoMode {
        let auto = screened_large(atomic, pipelined);
        for trial in 0..LARGE_WHOLE_TRIALS {
            assert_eq!(auto.choose(FULL), Way::Pipelined, "whole trial {trial}");
            auto.timed(Way::Pipelined, FULL, ms(pipelined));
        }
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
    fn a_screen_that_its_round_trip_makes_no_faster_than_atomic_is_followed_by_whole_trials_that_decide() {
        // The default sync_interval: per row the screen (35 µs + 10 µs of round trip) is as slow
        // as atomic (45 µs), whole pipelined claims are faster.
        let auto = screened_large(45.0, 35.0);
        for _ in 0..LARGE_WHOLE_TRIALS {
            assert_eq!(auto.choose(FULL), Way::Pipelined);
        }
        assert_eq!(auto.choose(FULL), Way::Atomic, "no more than the whole trials until they are timed");
        for _ in 0..LARGE_WHOLE_TRIALS {
            auto.timed(Way::Pipelined, FULL, ms(35.0));
        }
        assert!(atomic_share(&auto, FULL, LARGE_PROBE_EVERY) <= 1, "pipelined, but for a probe");

        // The whole trials are what decides: slower than atomic, large claims stay atomic.
        let auto = screened_large(45.0, 35.0);
        for _ in 0..LARGE_WHOLE_TRIALS {
            assert_eq!(auto.choose(FULL), Way::Pipelined);
            auto.timed(Way::Pipelined, FULL, ms(60.0));
        }
        let pipelined = LARGE_PROBE_EVERY - atomic_share(&auto, FULL, LARGE_PROBE_EVERY);
        assert!(pipelined <= 1, "atomic, but for a probe: {pipelined} pipelined");
    }

    #[test]
    fn a_screen_part_smaller_than_a_large_claim_is_a_large_claims_screen() {
        let auto = AutoMode::default();
        auto.timed(Way::Atomic, FULL, ms(45.0));
        assert_eq!(auto.choose(FULL), Way::PipelinedFirst(LARGE_TRIAL_ROWS));
        let part = LARGE_TRIAL_ROWS / SCREEN_PARTS;
        assert!(part < AUTO_ATOMIC_MIN_ROWS);
        auto.timed(Way::PipelinedFirst(part), part, ms(1.0));
        assert_eq!(auto.choose(FULL), Way::Pipelined, "a whole trial follows the screen");
        assert_eq!(auto.choose(SMALL), Way::Pipelined, "small claims: nothing timed, pipelined");
        auto.timed(Way::Pipelined, SMALL, ms(1.0));
        assert_eq!(auto.choose(SMALL), Way::Atomic, "small claims' own trial: the screen was not theirs");
    }

    #[test]
    fn a_screen_beyond_the_margin_sends_no_whole_claim_pipelined() {
        // sync_interval always: 100 fsyncs take 27 ms, 5.6 times atomic's 50 ms per 1,000 rows.
        let auto = screened_large(50.0, 270.0);
        let decisions = 4 * LARGE_PROBE_EVERY;
        let ways: Vec<Way> = (0..decisions).map(|_| auto.choose(FULL)).collect();
        assert!(!ways.contains(&Way::Pipelined), "no whole claim pipelined");
        let screens = ways.iter().filter(|w| matches!(w, Way::PipelinedFirst(_))).count() as u64;
        assert!(screens > 0 && screens <= probes(decisions, LARGE_PROBE_EVERY), "{screens} screens");
        // A probe's screen that passes (the broker stopped fsyncing each message) brings whole
        // trials.
        auto.timed(Way::PipelinedFirst(LARGE_TRIAL_ROWS), LARGE_TRIAL_ROWS, ms(4.5));
        assert_eq!(auto.choose(FULL), Way::Pipelined);
    }

    #[test]
    fn the_first_samples_of_a_way_count_equally() {
        let auto = timed_small(1.0, 1.9);
        assert!(atomic_share(&auto, SMALL, 10) <= 1, "pipelined, faster");
        // Pipelined's second claim takes 3 ms: its mean (2 ms) is slower than atomic's 1.9 ms (a
        // moving average from the first sample would still say 1.25 ms).
        auto.timed(Way::Pipelined, SMALL, ms(3.0));
        assert!(atomic_share(&auto, SMALL, 10) >= 9, "atomic, faster");
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
        let auto = screened_large(50.0, 270.0);
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
