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

/// One inotify event about an entry of the watched directory.
#[derive(Clone, Debug)]
pub(crate) struct DirEvent {
    name: Option<OsString>,
    mask: AddWatchFlags,
}

impl DirEvent {
    /// Whether the event concerns the entry called `name`.
    pub(crate) fn is_about(&self, name: &str) -> bool {
        self.name.as_deref().is_some_and(|n| n == name)
    }

    /// Whether the entry appeared: created in the dir, or moved into it (as an atomic rename
    /// puts a file in place).
    pub(crate) fn is_creation(&self) -> bool {
        self.mask
            .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
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

/// A directory watched across the passes of a periodic rescan, through its absence, its deletion
/// and its recreation: the directory that holds device nodes appears only once the driver created
/// one, and the kubelet's registry dir may come and go. While it cannot be watched, the caller's
/// rescan tick covers it and each pass tries again.
pub(crate) struct WatchedDir {
    dir: PathBuf,
    watch: Option<DirWatch>,
    /// How often the caller rescans anyway, for the warning when the dir cannot be watched.
    polled_every: Duration,
    /// Whether the failure to watch the dir was logged since it last could be watched.
    warned: bool,
    /// How the watch is set up; a field only so a test can stand in for a failing inotify.
    open: fn(&Path) -> io::Result<DirWatch>,
}

impl WatchedDir {
    pub(crate) fn new(dir: PathBuf, polled_every: Duration) -> Self {
        WatchedDir {
            dir,
            watch: None,
            polled_every,
            warned: false,
            open: DirWatch::new,
        }
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
    ///
    /// A dir that is there but cannot be watched (out of inotify instances or watches, say) is
    /// only polled: that is said once, until a watch works again.
    fn rearm(&mut self) {
        if self.watch.is_some() || !self.dir.is_dir() {
            return;
        }
        match (self.open)(&self.dir) {
            Ok(watch) => {
                self.watch = Some(watch);
                self.warned = false;
            }
            Err(err) if !self.warned => {
                tracing::warn!(
                    dir = %self.dir.display(),
                    error = %err,
                    "cannot watch the directory with inotify; polling it every {} instead",
                    humantime::format_duration(self.polled_every)
                );
                self.warned = true;
            }
            Err(_) => {}
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
    use crate::testkit::log::Log;
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
        let mut watched = WatchedDir::new(dir.clone(), Duration::from_secs(5));
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

    #[tokio::test]
    async fn events_say_which_entry_appeared() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let mut watch = DirWatch::new(dir.path()).unwrap();
        let socket = dir.path().join("kubelet.sock");
        let staged = outside.path().join("kubelet.sock");
        let mut seen = Vec::new();
        let changes: [(&str, &dyn Fn() -> io::Result<()>); 5] = [
            ("created", &|| std::fs::write(&socket, b"")),
            ("chmod", &|| {
                std::fs::set_permissions(
                    &socket,
                    std::os::unix::fs::PermissionsExt::from_mode(0o600),
                )
            }),
            ("removed", &|| std::fs::remove_file(&socket)),
            ("moved in", &|| {
                std::fs::write(&staged, b"").and_then(|()| std::fs::rename(&staged, &socket))
            }),
            ("other", &|| {
                std::fs::write(dir.path().join("other.sock"), b"")
            }),
        ];
        for (change, make) in changes {
            make().unwrap();
            let events = timeout(Duration::from_secs(5), watch.next())
                .await
                .unwrap()
                .unwrap();
            let creations = events
                .iter()
                .filter(|e| e.is_about("kubelet.sock") && e.is_creation())
                .count();
            seen.push((change, creations));
        }
        assert_eq!(
            seen,
            [
                ("created", 1),
                ("chmod", 0),
                ("removed", 0),
                ("moved in", 1),
                ("other", 0)
            ]
        );
    }

    fn out_of_inotify_instances(_: &Path) -> io::Result<DirWatch> {
        Err(nix::errno::Errno::EMFILE.into())
    }

    #[tokio::test]
    async fn a_dir_inotify_cannot_watch_is_left_to_the_rescans_and_said_so_once() {
        let log = Log::default();
        let _capture = log.capture();
        let root = tempfile::tempdir().unwrap();
        let mut watched = WatchedDir::new(root.path().to_owned(), Duration::from_secs(5));
        watched.open = out_of_inotify_instances;
        for pass in 0..3 {
            let node = root.path().join(format!("uverbs{pass}"));
            let changed = watched.changed();
            std::fs::write(&node, b"").unwrap();
            assert!(
                timeout(Duration::from_millis(50), changed).await.is_err(),
                "a change with no watch"
            );
        }
        let warnings = log.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        let dir = root.path().display().to_string();
        for part in [
            "cannot watch the directory with inotify; polling it every 5s instead",
            &dir,
            "Too many open files",
        ] {
            assert!(warnings[0].contains(part), "{part:?} in {}", warnings[0]);
        }

        // Once inotify works again, changes wake the rescan, and a later failure is said again.
        watched.open = DirWatch::new;
        let node = root.path().join("uverbs0");
        assert!(fires(&mut watched, || std::fs::remove_file(&node)).await);
        assert!(fires(&mut watched, || std::fs::remove_dir_all(root.path())).await);
        std::fs::create_dir(root.path()).unwrap();
        watched.open = out_of_inotify_instances;
        assert!(timeout(Duration::ZERO, watched.changed()).await.is_err());
        assert_eq!(log.warnings().len(), 2);
    }
}
