//! Retry delays as a value: exponential growth, a ceiling, and jitter so that many rows or messages
//! failing together (a broker restart) do not retry in lock-step.

use std::time::Duration;

/// Exponential backoff with "equal jitter": the delay for attempt `n` lies in
/// `[(1 - jitter) * d, d]` where `d = min(max, initial * multiplier^(n - 1))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    /// Fraction of the delay that is randomized, 0.0 to 1.0.
    pub jitter: f64,
}

impl Default for Backoff {
    /// 1 s doubling to 5 min, half of it jittered: quick recovery from a blip, slow polling of an outage.
    fn default() -> Self {
        Self { initial: Duration::from_secs(1), max: Duration::from_secs(300), multiplier: 2.0, jitter: 0.5 }
    }
}

impl Backoff {
    /// The un-jittered delay after the `attempt`-th failure (1-based; 0 is treated as 1).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1).min(64) as i32;
        let secs = self.initial.as_secs_f64() * self.multiplier.powi(exponent);
        if !secs.is_finite() || secs >= self.max.as_secs_f64() { self.max } else { Duration::from_secs_f64(secs) }
    }

    /// The delay for `attempt` given a uniform random `unit` in `[0, 1)`. Pure, for tests.
    pub fn delay_with(&self, attempt: u32, unit: f64) -> Duration {
        let ceiling = self.ceiling(attempt);
        let jitter = self.jitter.clamp(0.0, 1.0);
        ceiling.mul_f64(1.0 - jitter + jitter * unit.clamp(0.0, 1.0))
    }

    /// The delay for `attempt` with fresh randomness.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_with(attempt, rand::random::<f64>())
    }

    /// The longest time a row can be retried before `max_attempts` runs out: the sum of ceilings.
    /// Compared against the broker's duplicate window at startup.
    pub fn horizon(&self, max_attempts: u32) -> Duration {
        (1..max_attempts).map(|a| self.ceiling(a)).sum()
    }

    /// Runs `attempt` until it succeeds, fails with an error `transient` rejects, or fails at or
    /// after `deadline`; returns that last result. The pause before a try is cut to the time left,
    /// so the last try starts at the deadline: a caller given 60 s waits 60 s, not up to one
    /// pause less. `retrying` sees each error that is tried again, with the pause before the next
    /// try (to log it).
    ///
    /// For startup steps that wait out a broker that is still electing or restarting: the
    /// callers decide what is transient and say in their logs what they wait for.
    pub async fn retry_until<T, E, Fut>(
        &self,
        deadline: tokio::time::Instant,
        mut attempt: impl FnMut() -> Fut,
        mut transient: impl FnMut(&E) -> bool,
        mut retrying: impl FnMut(&E, Duration),
    ) -> Result<T, E>
    where
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        let mut failures = 0;
        loop {
            let error = match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            failures += 1;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if !transient(&error) || left.is_zero() {
                return Err(error);
            }
            let pause = self.delay(failures).min(left);
            retrying(&error, pause);
            tokio::time::sleep(pause).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff =
        Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(2), multiplier: 2.0, jitter: 0.5 };

    #[test]
    fn grows_exponentially_up_to_the_ceiling() {
        assert_eq!(B.ceiling(0), Duration::from_millis(100));
        assert_eq!(B.ceiling(1), Duration::from_millis(100));
        assert_eq!(B.ceiling(2), Duration::from_millis(200));
        assert_eq!(B.ceiling(5), Duration::from_millis(1600));
        assert_eq!(B.ceiling(6), Duration::from_secs(2));
        assert_eq!(B.ceiling(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn jitter_stays_within_its_band() {
        assert_eq!(B.delay_with(3, 0.0), Duration::from_millis(200));
        assert_eq!(B.delay_with(3, 1.0), Duration::from_millis(400));
        for _ in 0..1000 {
            let d = B.delay(3);
            assert!(d >= Duration::from_millis(200) && d <= Duration::from_millis(400), "{d:?}");
        }
    }

    #[test]
    fn horizon_sums_the_waits_between_attempts() {
        // 3 attempts wait twice: 100 ms + 200 ms.
        assert_eq!(B.horizon(3), Duration::from_millis(300));
        assert_eq!(B.horizon(1), Duration::ZERO);
    }

    const QUICK: Backoff =
        Backoff { initial: Duration::from_millis(1), max: Duration::from_millis(4), multiplier: 2.0, jitter: 0.0 };

    /// Fails with `errors` in turn, then succeeds; counts its calls.
    async fn run(errors: &[&'static str], patience: Duration) -> (Result<u32, &'static str>, u32, Vec<Duration>) {
        let calls = std::cell::Cell::new(0u32);
        let mut pauses = Vec::new();
        let result = QUICK
            .retry_until(
                tokio::time::Instant::now() + patience,
                || {
                    let call = calls.get();
                    calls.set(call + 1);
                    async move { errors.get(call as usize).map_or(Ok(call), |e| Err(*e)) }
                },
                |error| *error == "timed out",
                |_, pause| pauses.push(pause),
            )
            .await;
        (result, calls.get(), pauses)
    }

    #[tokio::test(start_paused = true)]
    async fn retry_until_tries_again_through_transient_errors_with_growing_pauses() {
        let (result, calls, pauses) = run(&["timed out"; 3], Duration::from_secs(60)).await;
        assert_eq!(result, Ok(3));
        assert_eq!(calls, 4);
        assert_eq!(pauses, [1, 2, 4].map(Duration::from_millis));
    }

    #[tokio::test(start_paused = true)]
    async fn retry_until_returns_an_error_it_is_told_is_not_transient_at_once() {
        let (result, calls, pauses) = run(&["timed out", "refused", "timed out"], Duration::from_secs(60)).await;
        assert_eq!(result, Err("refused"));
        assert_eq!(calls, 2);
        assert_eq!(pauses.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_until_tries_last_at_the_deadline_and_returns_that_error() {
        // Pauses of 1, 2, 4, 4, ... ms: after three (7 ms) the fourth is cut to the 3 ms left, and
        // the try at 10 ms is the last. Tokio's clock is paused: the pauses take what they say.
        let start = tokio::time::Instant::now();
        let (result, calls, pauses) = run(&["timed out"; 100], Duration::from_millis(10)).await;
        assert_eq!(result, Err("timed out"));
        assert_eq!(calls, 5);
        assert_eq!(pauses, [1, 2, 4, 3].map(Duration::from_millis));
        assert_eq!(start.elapsed(), Duration::from_millis(10));
        let (result, calls, _) = run(&["timed out"; 100], Duration::ZERO).await;
        assert_eq!((result, calls), (Err("timed out"), 1));
    }
}
