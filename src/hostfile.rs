//! Files the plugin keeps on the host for other programs to read: the NFD feature file and the
//! CDI spec. Each is rendered from the device snapshot, so it follows the same state the kubelet
//! is served from.
//!
//! A file is replaced by rename, so a reader never sees half of it; a failed write is retried
//! after a pause even if nothing changes, because a reader may depend on the file (the runtime
//! cannot start a CDI container without it); and the file is removed on exit, so a node without
//! the plugin does not keep describing devices nobody serves.

use std::fs::Permissions;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::state::{DeviceReader, Holdings, Inventory, Reader};

/// One file that mirrors the snapshot.
pub(crate) struct HostFile {
    pub path: PathBuf,
    /// Names the file in log lines, e.g. "CDI spec".
    pub what: &'static str,
    /// How often the file on disk is compared with what was written, and a failed write tried
    /// again: the rescan interval.
    pub recheck: Duration,
    /// The file's permission bits, whatever the umask.
    pub mode: u32,
    /// Counts failed writes, when the file's failures are exposed as a metric.
    pub failures: Option<Counter>,
    /// Asked on exit: a reason to leave the file in place instead of removing it.
    pub keep_on_exit: Option<KeepOnExit>,
    /// The PodResources view, for a file that also names what pods hold: rendered again when
    /// it changes. Without it, renders see an empty view.
    pub holdings: Option<Reader<Arc<Holdings>>>,
    /// Signals a change of something else the rendering reads, such as the extra device nodes
    /// the CDI spec names: rendered again at each signal, not only at the next device change.
    pub also: Option<Changes>,
}

/// Signals, one item per change, that what a rendering reads besides the snapshot changed; it
/// ends when nothing will change any more.
pub(crate) type Changes = Pin<Box<dyn Stream<Item = ()> + Send>>;

/// Asked once on exit, after the last write: why the file must outlive the plugin, if it must.
pub(crate) type KeepOnExit =
    Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Option<String>> + Send>> + Send + Sync>;

/// What identifies the file as written: a change to any of these means someone else replaced,
/// edited, truncated or re-moded it. Comparing these costs one `lstat`; comparing the text
/// would read a spec of megabytes every rescan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    mode: u32,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Identity {
    fn of(path: &Path) -> Option<Identity> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        Some(Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            mode: meta.mode(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// The text on disk and how to tell that it is still there.
struct Written {
    text: String,
    identity: Option<Identity>,
}

/// What `follow` knows of the file between renders.
#[derive(Default)]
struct OnDisk {
    /// What was last written, while it is believed to be there.
    written: Option<Written>,
    /// The kind of error of the failing streak: the message names a random temp file, so
    /// comparing messages would log every retry.
    failing: Option<io::ErrorKind>,
    /// Whether the last recheck found the file changed, so a streak of tampering logs once.
    tampered: bool,
}

/// What a rendering reads, and how `follow` learns that it changed: the receivers it subscribed
/// to the readers it was given, each of which remembers what the last render saw.
struct Inputs {
    devices: watch::Receiver<Arc<Inventory>>,
    holdings: Option<watch::Receiver<Arc<Holdings>>>,
    also: Option<Changes>,
    /// Holds the snapshot's sender, which closes `devices` only when dropped: so `devices`
    /// never ends, and waiting on it means waiting for a change.
    _sender: DeviceReader,
}

/// Why `follow` stopped waiting.
enum Wake {
    /// Something the rendering reads changed.
    Changed,
    /// The recheck interval passed with no change.
    Recheck,
    Shutdown,
}

impl Inputs {
    /// `render` of the current snapshot and view, marking both seen, so the next wait ends
    /// only on a later change.
    fn render(
        &mut self,
        render: impl Fn(&Inventory, &Holdings) -> Option<String>,
    ) -> Option<String> {
        let view = self
            .holdings
            .as_mut()
            .map(|view| view.borrow_and_update().clone())
            .unwrap_or_default();
        render(&self.devices.borrow_and_update(), &view)
    }

    /// Waits for a change, the recheck after `recheck` (never without one), or `shutdown`. A
    /// view or a signal that ends counts as a change once, then is waited on no more.
    async fn next(&mut self, recheck: Option<Duration>, shutdown: &CancellationToken) -> Wake {
        tokio::select! {
            _ = shutdown.cancelled() => Wake::Shutdown,
            // Fails only once the channel is closed, which `_sender` rules out.
            _ = self.devices.changed() => Wake::Changed,
            alive = view_changed(&mut self.holdings) => {
                if !alive {
                    self.holdings = None;
                }
                Wake::Changed
            }
            alive = signalled(&mut self.also) => {
                if !alive {
                    self.also = None;
                }
                Wake::Changed
            }
            _ = pause(recheck) => Wake::Recheck,
        }
    }
}

impl HostFile {
    /// Keeps the file equal to `render` of the current snapshot, absent while that is `None`,
    /// until `shutdown`, then removes it unless `keep_on_exit` gives a reason not to. Never
    /// fails: a write error is logged, counted and retried. A file removed or changed by
    /// someone else is written again at the next recheck: a deleted CDI spec would otherwise
    /// fail every new EFA container while its text stays the same.
    pub(crate) async fn follow(
        mut self,
        state: DeviceReader,
        render: impl Fn(&Inventory, &Holdings) -> Option<String>,
        shutdown: CancellationToken,
    ) {
        let mut inputs = Inputs {
            devices: state.subscribe(),
            holdings: self.holdings.take().map(|view| view.subscribe()),
            also: self.also.take(),
            _sender: state,
        };
        let mut disk = OnDisk::default();
        'follow: loop {
            self.mirror(inputs.render(&render), &mut disk);
            // Rendering a large spec costs; an intact file waits for a change without one.
            let recheck =
                (disk.written.is_some() || disk.failing.is_some()).then_some(self.recheck);
            loop {
                match inputs.next(recheck, &shutdown).await {
                    Wake::Shutdown => break 'follow,
                    Wake::Changed => break,
                    Wake::Recheck if self.stale(&mut disk) => break,
                    Wake::Recheck => {}
                }
            }
        }
        self.leave(disk.written.is_some()).await;
    }

    /// Brings the file on disk to `wanted`: removed when nothing is wanted, written when the
    /// text is not the one last written.
    fn mirror(&self, wanted: Option<String>, disk: &mut OnDisk) {
        match wanted {
            None => {
                if disk.written.take().is_some() {
                    self.remove();
                }
            }
            Some(text) if disk.written.as_ref().is_some_and(|w| w.text == text) => {}
            Some(text) => self.write(text, disk),
        }
    }

    /// Writes `text`; a failure is counted, and logged once per streak of one kind of error.
    fn write(&self, text: String, disk: &mut OnDisk) {
        match write_atomically(&self.path, &text, self.mode) {
            Ok(()) => {
                if disk.failing.take().is_some() {
                    tracing::info!(file = %self.path.display(), "wrote the {} after failures", self.what);
                }
                disk.written = Some(Written {
                    identity: Identity::of(&self.path),
                    text,
                });
            }
            Err(err) => {
                if let Some(failures) = &self.failures {
                    failures.inc();
                }
                if disk.failing != Some(err.kind()) {
                    tracing::warn!(
                        file = %self.path.display(),
                        error = %err,
                        retry = %humantime::format_duration(self.recheck),
                        "cannot write the {}; retrying",
                        self.what
                    );
                }
                disk.failing = Some(err.kind());
            }
        }
    }

    /// At a recheck: whether the file must be written again, because the last write failed or
    /// someone else removed or changed the file since. A tampered file is forgotten, so the
    /// next render writes it whatever its text.
    fn stale(&self, disk: &mut OnDisk) -> bool {
        if disk.failing.is_some() {
            return true;
        }
        let intact = disk
            .written
            .as_ref()
            .is_none_or(|w| Identity::of(&self.path) == w.identity);
        if intact {
            disk.tampered = false;
            return false;
        }
        if !disk.tampered {
            tracing::warn!(
                file = %self.path.display(),
                "the {} was removed or changed by someone else; writing it again",
                self.what
            );
        }
        disk.tampered = true;
        disk.written = None;
        true
    }

    /// On exit: removes the file, unless it was `written` and `keep_on_exit` gives a reason
    /// to keep it.
    async fn leave(mut self, written: bool) {
        let keep = match self.keep_on_exit.take() {
            Some(keep) if written => keep().await,
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

/// Waits for the view to change; false once its writer is gone. Forever without a view.
async fn view_changed(view: &mut Option<watch::Receiver<Arc<Holdings>>>) -> bool {
    match view {
        Some(view) => view.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Waits for the next signal; false once the signals end. Forever without any.
async fn signalled(changes: &mut Option<Changes>) -> bool {
    match changes {
        Some(changes) => changes.next().await.is_some(),
        None => std::future::pending().await,
    }
}

/// Sleeps for `duration`, or forever when there is nothing to recheck.
async fn pause(duration: Option<Duration>) {
    match duration {
        Some(duration) => tokio::time::sleep(duration).await,
        None => std::future::pending().await,
    }
}

/// Replaces `path` with `text` in one step: a temporary file in the same dir (created if
/// missing), given `mode`, then a rename. The temporary name starts with a dot and has no
/// extension, so readers that pick files by suffix (`*.json` for CDI) skip it.
pub(crate) fn write_atomically(path: &Path, text: &str, mode: u32) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::Builder::new()
        .prefix(".efa-device-plugin.")
        .tempfile_in(dir)?;
    // The temp file is created 0600; fchmod is not subject to the umask.
    file.as_file()
        .set_permissions(Permissions::from_mode(mode))?;
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

    /// A file that renders the snapshot alone and is removed on exit.
    fn test_file(path: &Path, recheck: Duration, failures: Option<Counter>) -> HostFile {
        HostFile {
            path: path.to_owned(),
            what: "test file",
            recheck,
            mode: 0o644,
            failures,
            keep_on_exit: None,
            holdings: None,
            also: None,
        }
    }

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
        let file = test_file(&path, Duration::from_millis(20), Some(failures.clone()));
        let state = DeviceState::unguarded();
        state.apply(inventory(Shape::P4d).devices().cloned().collect());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(file.follow(
            state.reader(),
            |inventory, _| Some(inventory.devices().len().to_string()),
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

    /// `follow` has no arm for a closed snapshot channel because its reader keeps the sender:
    /// with every writer gone it neither stops (removing the file) nor wakes for nothing.
    #[tokio::test(start_paused = true)]
    async fn follow_outlives_the_snapshots_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out");
        let recheck = Duration::from_secs(1);
        let file = test_file(&path, recheck, None);
        let state = DeviceState::unguarded();
        state.apply(inventory(Shape::P4d).devices().cloned().collect());
        let renders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = renders.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(file.follow(
            state.reader(),
            move |inventory, _| {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Some(inventory.devices().len().to_string())
            },
            shutdown.clone(),
        ));
        wait_until("the first write", || {
            std::fs::read_to_string(&path).is_ok_and(|text| text == "4")
        })
        .await;
        drop(state);
        // Yields and explicit steps rather than a sleep: a follower that spun on a closed
        // channel would never let paused time advance, and the test would hang, not fail.
        for _ in 0..5 {
            tokio::time::advance(recheck).await;
            for _ in 0..50 {
                tokio::task::yield_now().await;
            }
        }
        assert!(!task.is_finished(), "follow stopped with the writer");
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "4");
        shutdown.cancel();
        task.await.unwrap();
        assert!(!path.exists());
    }
}
