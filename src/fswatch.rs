//! Async inotify on one directory, so the plugin reacts to socket and device-node changes at once
//! instead of polling.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

/// One inotify event about an entry of the watched directory.
#[derive(Clone, Debug)]
pub(crate) struct DirEvent {
    pub name: Option<OsString>,
    pub mask: AddWatchFlags,
}

impl DirEvent {
    pub(crate) fn is_about(&self, name: &str) -> bool {
        self.name.as_deref().is_some_and(|n| n == name)
    }
}

struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

pub(crate) struct DirWatch {
    fd: AsyncFd<InotifyFd>,
    dead: bool,
}

impl DirWatch {
    /// Entry creations, deletions and renames, plus attribute changes (a device node replaced in
    /// place by `mknod` after `rm` shows as delete + create; a `chmod` as attrib).
    pub(crate) fn new(dir: &Path) -> io::Result<Self> {
        #[cfg(test)]
        INOTIFY_INITS.with(|inits| inits.set(inits.get() + 1));
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        inotify.add_watch(
            dir,
            AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_ATTRIB
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_ONLYDIR,
        )?;
        // SAFETY: `Inotify` owns its descriptor and keeps it open until it is dropped, which
        // happens only when the `AsyncFd` holding it is dropped, and `as_raw_fd` always returns
        // that one descriptor. The crate denies unsafe code; tokio's safe constructors are
        // deprecated as unsound (tokio#8587), so this is the one allowed exception.
        #[allow(unsafe_code)]
        let fd =
            unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }?;
        Ok(DirWatch { fd, dead: false })
    }

    /// The watched directory went away (or reading failed): this watch will never fire again
    /// and must be set up anew.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead
    }

    /// Waits for the next batch of events; fails once the watch is dead.
    pub(crate) async fn next(&mut self) -> io::Result<Vec<DirEvent>> {
        if self.dead {
            return Err(io::Error::other("the watched directory is gone"));
        }
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.get_inner().0.read_events() {
                Ok(events) => {
                    let ended = AddWatchFlags::IN_IGNORED | AddWatchFlags::IN_DELETE_SELF;
                    if events.iter().any(|e| e.mask.intersects(ended)) {
                        self.dead = true;
                        return Err(io::Error::other("the watched directory is gone"));
                    }
                    return Ok(events
                        .into_iter()
                        .map(|event| DirEvent {
                            name: event.name,
                            mask: event.mask,
                        })
                        .collect());
                }
                Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
                Err(err) => {
                    self.dead = true;
                    return Err(err.into());
                }
            }
        }
    }
}

/// The rhythm of a rescan of one directory: a pass every `interval`, and one at once on every
/// change in the directory, until shutdown.
pub(crate) struct Rescans {
    dir: WatchedDir,
    ticker: tokio::time::Interval,
    shutdown: CancellationToken,
}

impl Rescans {
    /// The first tick comes one `interval` from now: the caller has just made a pass.
    pub(crate) fn new(dir: PathBuf, interval: Duration, shutdown: CancellationToken) -> Self {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Rescans {
            dir: WatchedDir::new(dir),
            ticker,
            shutdown,
        }
    }

    /// Waits for the next pass to be due; false on shutdown.
    pub(crate) async fn due(&mut self) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = self.ticker.tick() => true,
            () = self.dir.changed() => true,
        }
    }
}

/// A directory watched across the passes of a periodic rescan, through its absence, its deletion
/// and its recreation: the directory that holds device nodes appears only once the driver created
/// one, and the kubelet's registry dir may come and go. While it cannot be watched, the caller's
/// rescan tick covers it and each pass tries again.
pub(crate) struct WatchedDir {
    dir: PathBuf,
    watch: Option<DirWatch>,
}

impl WatchedDir {
    pub(crate) fn new(dir: PathBuf) -> Self {
        WatchedDir { dir, watch: None }
    }

    /// Resolves on the next change in the directory, or when it goes away; never while it cannot
    /// be watched. The watch is set up when this is called, not when the future is first polled,
    /// so a change during the caller's next pass wakes it even if another `select!` branch won.
    pub(crate) fn changed(&mut self) -> impl Future<Output = ()> + '_ {
        self.rearm();
        async move {
            match &mut self.watch {
                Some(watch) => {
                    // A dead watch never fires again, and one that failed to read would fail
                    // again at once: either way the next pass sets it up anew.
                    if watch.next().await.is_err() {
                        self.watch = None;
                    }
                }
                None => std::future::pending().await,
            }
        }
    }

    /// Stats the directory before opening an inotify instance: a node without EFA has no
    /// directory to watch, and trying anyway would open and close a descriptor on every pass.
    /// Keeping one instance and retrying only `add_watch` would also avoid that, but would hold
    /// a descriptor for nothing on such nodes, and after a deletion would have to tell the old
    /// watch's queued events from the new one's.
    fn rearm(&mut self) {
        if self.watch.is_none() && self.dir.is_dir() {
            self.watch = DirWatch::new(&self.dir).ok();
        }
    }
}

#[cfg(test)]
thread_local! {
    /// inotify instances this thread opened: tests run in parallel threads of one process, so
    /// counting descriptors in `/proc/self/fd` would see the other tests' watches too.
    static INOTIFY_INITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many inotify instances the current thread has opened so far.
#[cfg(test)]
pub(crate) fn inotify_inits() -> usize {
    INOTIFY_INITS.with(std::cell::Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::time::timeout;

    /// Whether `changed`, called before `change`, resolves soon after it.
    async fn fires(watched: &mut WatchedDir, change: impl FnOnce() -> io::Result<()>) -> bool {
        let changed = watched.changed();
        change().unwrap();
        timeout(Duration::from_secs(5), changed).await.is_ok()
    }

    /// Makes `passes` passes that see no change; returns the inotify instances they opened.
    async fn idle_passes(watched: &mut WatchedDir, passes: usize) -> usize {
        let inits = inotify_inits();
        for _ in 0..passes {
            assert!(timeout(Duration::ZERO, watched.changed()).await.is_err());
        }
        inotify_inits() - inits
    }

    #[tokio::test]
    async fn a_missing_dir_is_retried_without_a_descriptor_and_watched_once_it_exists() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("infiniband");
        let mut watched = WatchedDir::new(dir.clone());
        assert_eq!(idle_passes(&mut watched, 100).await, 0, "a missing dir");

        let inits = inotify_inits();
        let node = dir.join("uverbs0");
        std::fs::create_dir(&dir).unwrap();
        assert!(fires(&mut watched, || std::fs::write(&node, b"")).await);
        assert!(fires(&mut watched, || std::fs::remove_file(&node)).await);
        assert_eq!(idle_passes(&mut watched, 100).await, 0, "a watched dir");
        assert_eq!(
            inotify_inits() - inits,
            1,
            "one instance while the dir lasts"
        );

        assert!(fires(&mut watched, || std::fs::remove_dir(&dir)).await);
        assert_eq!(idle_passes(&mut watched, 100).await, 0, "a deleted dir");

        std::fs::create_dir(&dir).unwrap();
        assert!(fires(&mut watched, || std::fs::write(&node, b"")).await);
        assert_eq!(
            inotify_inits() - inits,
            2,
            "the recreated dir is watched anew"
        );
    }
}
