//! Pauses between the retries of something that keeps failing: short at first, so a passing
//! hiccup costs little, and growing to a cap, so a lasting failure is not hammered.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Pauses that start at `first` and double with each retry up to `cap`, until [`Backoff::reset`].
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) const fn new(first: Duration, cap: Duration) -> Self {
        Backoff {
            first,
            cap,
            next: first,
        }
    }

    /// The same pause before every retry.
    pub(crate) const fn constant(pause: Duration) -> Self {
        Backoff::new(pause, pause)
    }

    /// The longest pause.
    pub(crate) fn cap(&self) -> Duration {
        self.cap
    }

    /// The pause before the next retry; the one after it is twice as long, up to the cap.
    pub(crate) fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = pause.saturating_mul(2).min(self.cap);
        pause
    }

    /// The failures are over: the next pause is the first one again.
    pub(crate) fn reset(&mut self) {
        self.next = self.first;
    }

    /// Sleeps the next pause; false if `shutdown` comes first.
    pub(crate) async fn sleep(&mut self, shutdown: &CancellationToken) -> bool {
        let pause = self.next_pause();
        tokio::select! {
            _ = shutdown.cancelled() => false,
            () = tokio::time::sleep(pause) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// The pauses `backoff` sleeps before each of `retries` retries, on paused time.
    async fn slept(backoff: &mut Backoff, retries: usize) -> Vec<Duration> {
        let shutdown = CancellationToken::new();
        let mut pauses = Vec::new();
        for _ in 0..retries {
            let started = Instant::now();
            assert!(backoff.sleep(&shutdown).await);
            pauses.push(started.elapsed());
        }
        pauses
    }

    fn ms(millis: &[u64]) -> Vec<Duration> {
        millis.iter().copied().map(Duration::from_millis).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn pauses_double_up_to_the_cap_and_start_over_after_a_reset() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        assert_eq!(
            slept(&mut backoff, 9).await,
            ms(&[100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000])
        );
        backoff.reset();
        assert_eq!(slept(&mut backoff, 2).await, ms(&[100, 200]));
        assert_eq!(backoff.cap(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_constant_backoff_never_grows() {
        let mut backoff = Backoff::constant(Duration::from_secs(5));
        assert_eq!(slept(&mut backoff, 3).await, ms(&[5000, 5000, 5000]));
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_cuts_a_pause_short() {
        let shutdown = CancellationToken::new();
        let mut backoff = Backoff::constant(Duration::from_secs(5));
        let started = Instant::now();
        let cancel = {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                shutdown.cancel();
            })
        };
        assert!(!backoff.sleep(&shutdown).await);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        cancel.await.unwrap();
    }

    #[test]
    fn a_cap_far_beyond_the_first_pause_does_not_overflow() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::MAX);
        let last = (0..80).map(|_| backoff.next_pause()).last().unwrap();
        assert_eq!(last, Duration::MAX);
    }
}
