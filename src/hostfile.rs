//! Files the plugin keeps on the host for other programs to read: the NFD feature file and the
//! CDI spec. Each is rendered from the device snapshot, so it follows the same state the kubelet
//! is served from.
//!
//! A file is replaced by rename, so a reader never sees half of it; a failed write is retried
//! after a pause even if nothing changes, because a reader may depend on the file (the runtime
//! cannot start a CDI container without it); and the file is removed on exit, so a node without
//! the plugin does not keep describing devices nobody serves.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;

use crate::state::{DeviceReader, Inventory};

/// One file that mirrors the snapshot.
pub(crate) struct HostFile {
    pub path: PathBuf,
    /// Names the file in log lines, e.g. "CDI spec".
    pub what: &'static str,
    /// The pause before writing again after a failure.
    pub retry: Duration,
    /// Counts failed writes, when the file's failures are exposed as a metric.
    pub failures: Option<Counter>,
    /// Asked on exit: a reason to leave the file in place instead of removing it.
    pub keep_on_exit: Option<KeepOnExit>,
}

/// Asked once on exit, after the last write: why the file must outlive the plugin, if it must.
pub(crate) type KeepOnExit =
    Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Option<String>> + Send>> + Send + Sync>;

impl HostFile {
    /// Keeps the file equal to `render` of the current snapshot, absent while that is `None`,
    /// until `shutdown`, then removes it unless `keep_on_exit` gives a reason not to. Never fails: a write error is logged, counted and
    /// retried.
    pub(crate) async fn follow(
        mut self,
        state: DeviceReader,
        render: impl Fn(&Inventory) -> Option<String>,
        shutdown: CancellationToken,
    ) {
        let mut devices = state.subscribe();
        let mut written: Option<String> = None;
        // The error of the failing streak, so a streak logs once rather than every retry.
        let mut failing: Option<String> = None;
        loop {
            let wanted = render(&devices.borrow_and_update());
            let mut retry = None;
            if wanted.is_none() && written.take().is_some() {
                self.remove();
            }
            if let Some(text) = wanted.filter(|text| written.as_ref() != Some(text)) {
                match write_atomically(&self.path, &text) {
                    Ok(()) => {
                        if failing.take().is_some() {
                            tracing::info!(file = %self.path.display(), "wrote the {} after failures", self.what);
                        }
                        written = Some(text);
                    }
                    Err(err) => {
                        if let Some(failures) = &self.failures {
                            failures.inc();
                        }
                        let err = err.to_string();
                        if failing.as_ref() != Some(&err) {
                            tracing::warn!(
                                file = %self.path.display(),
                                error = %err,
                                retry = %humantime::format_duration(self.retry),
                                "cannot write the {}; retrying",
                                self.what
                            );
                        }
                        failing = Some(err);
                        retry = Some(self.retry);
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = devices.changed() => if changed.is_err() { break },
                _ = pause(retry) => {}
            }
        }
        let keep = match self.keep_on_exit.take() {
            Some(keep) if written.is_some() => keep().await,
            _ => None,
        };
        match keep {
            Some(reason) => tracing::info!(
                file = %self.path.display(),
                "keeping the {}: {reason}",
                self.what
            ),
            None => self.remove(),
        }
    }

    fn remove(&self) {
        match std::fs::remove_file(&self.path) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => tracing::warn!(
                file = %self.path.display(),
                error = %err,
                "cannot remove the {}",
                self.what
            ),
            _ => {}
        }
    }
}

/// Sleeps for `duration`, or forever when there is nothing to retry.
async fn pause(duration: Option<Duration>) {
    match duration {
        Some(duration) => tokio::time::sleep(duration).await,
        None => std::future::pending().await,
    }
}

/// Replaces `path` with `text` in one step: a temporary file in the same dir (created if
/// missing), then a rename. The temporary name starts with a dot and has no extension, so
/// readers that pick files by suffix (`*.json` for CDI) skip it.
pub(crate) fn write_atomically(path: &Path, text: &str) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::Builder::new()
        .prefix(".efa-device-plugin.")
        .tempfile_in(dir)?;
    file.write_all(text.as_bytes())?;
    file.as_file().sync_all()?;
    file.persist(path).map_err(|err| err.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::DeviceState;
    use crate::testkit::simulate::{Shape, inventory};

    async fn wait_until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test]
    async fn a_failed_write_is_counted_and_retried_without_a_change() {
        let dir = tempfile::tempdir().unwrap();
        // A regular file where the directory should be: every write fails until it goes.
        let blocker = dir.path().join("specs");
        std::fs::write(&blocker, "").unwrap();
        let path = blocker.join("out");
        let failures = Counter::default();
        let file = HostFile {
            path: path.clone(),
            what: "test file",
            retry: Duration::from_millis(20),
            failures: Some(failures.clone()),
            keep_on_exit: None,
        };
        let state = DeviceState::default();
        state.apply(inventory(Shape::P4d).devices().cloned().collect());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(file.follow(
            state.reader(),
            |inventory| Some(inventory.devices().len().to_string()),
            shutdown.clone(),
        ));
        wait_until("two failed attempts", || failures.get() >= 2).await;
        std::fs::remove_file(&blocker).unwrap();
        wait_until("the retried write", || {
            std::fs::read_to_string(&path).is_ok_and(|text| text == "4")
        })
        .await;
        let settled = failures.get();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(failures.get(), settled, "no retries once written");
        shutdown.cancel();
        task.await.unwrap();
        assert!(!path.exists());
    }
}
