//! The rhythm every periodic rescan of the plugin follows: a pass every interval, one at once when
//! a watched directory changes, and none after shutdown.

use std::path::PathBuf;
use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::fswatch::WatchedDir;

/// When the next pass of a rescan is due. The caller makes its first pass at once, then one each
/// time [`Rescans::due`] says so, until it says shutdown.
pub(crate) struct Rescans {
    ticker: Interval,
    dir: Option<WatchedDir>,
    settle: Option<Duration>,
    shutdown: CancellationToken,
}

impl Rescans {
    /// A pass every `interval`, the first one `interval` from now: the caller makes its first
    /// pass right away. A pass that overruns delays the ticks after it rather than bunching them.
    pub(crate) fn every(interval: Duration, shutdown: CancellationToken) -> Self {
        let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Rescans {
            ticker,
            dir: None,
            settle: None,
            shutdown,
        }
    }

    /// Also a pass at once on every change in `dir`; while it cannot be watched, the ticks
    /// cover it.
    pub(crate) fn watching(mut self, dir: PathBuf) -> Self {
        self.dir = Some(WatchedDir::new(dir, self.ticker.period()));
        self
    }

    /// Waits `settle` after a change before the pass, so a burst of changes costs one pass.
    pub(crate) fn settling(mut self, settle: Duration) -> Self {
        self.settle = Some(settle);
        self
    }

    /// Waits for the next pass to be due; false on shutdown.
    pub(crate) async fn due(&mut self) -> bool {
        // Called now, not when first polled: `changed` sets the watch up, and it must be set up
        // even when another branch wins, so that a change during the coming pass is seen.
        let changed = self.dir.as_mut().map(WatchedDir::changed);
        let changed = async {
            match changed {
                Some(changed) => changed.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = self.ticker.tick() => true,
            () = changed => {
                if let Some(settle) = self.settle {
                    tokio::time::sleep(settle).await;
                }
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long `rescans` waits for its next pass, on paused time.
    async fn wait(rescans: &mut Rescans) -> Option<Duration> {
        let started = Instant::now();
        rescans.due().await.then(|| started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn passes_come_every_interval_until_shutdown() {
        let shutdown = CancellationToken::new();
        let mut rescans = Rescans::every(Duration::from_secs(5), shutdown.clone());
        assert_eq!(wait(&mut rescans).await, Some(Duration::from_secs(5)));
        // A pass that overran the next tick: the pass after it comes one interval later.
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert_eq!(wait(&mut rescans).await, Some(Duration::ZERO));
        assert_eq!(wait(&mut rescans).await, Some(Duration::from_secs(5)));
        shutdown.cancel();
        assert_eq!(wait(&mut rescans).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_in_the_watched_dir_brings_the_pass_forward_after_the_settle() {
        let dir = tempfile::tempdir().unwrap();
        let mut rescans = Rescans::every(Duration::from_secs(60), CancellationToken::new())
            .watching(dir.path().to_owned())
            .settling(Duration::from_millis(20));
        let due = wait(&mut rescans);
        tokio::pin!(due);
        // One poll sets the watch up; the change is then seen long before the tick.
        assert!(
            tokio::time::timeout(Duration::ZERO, &mut due)
                .await
                .is_err()
        );
        std::fs::write(dir.path().join("uverbs0"), b"").unwrap();
        assert_eq!(due.await, Some(Duration::from_millis(20)));
    }
}
