//! Async inotify on one directory, so the plugin reacts to socket and device-node changes at once
//! instead of polling.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// One inotify event about an entry of the watched directory.
#[derive(Clone, Debug)]
pub struct DirEvent {
    pub name: Option<OsString>,
    pub mask: AddWatchFlags,
}

impl DirEvent {
    pub fn is_about(&self, name: &str) -> bool {
        self.name.as_deref().is_some_and(|n| n == name)
    }
}

struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

pub struct DirWatch {
    fd: AsyncFd<InotifyFd>,
    dead: bool,
}

impl DirWatch {
    /// Entry creations, deletions and renames, plus attribute changes (a device node replaced in
    /// place by `mknod` after `rm` shows as delete + create; a `chmod` as attrib).
    pub fn new(dir: &Path) -> io::Result<Self> {
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
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Waits for the next batch of events; fails once the watch is dead.
    pub async fn next(&mut self) -> io::Result<Vec<DirEvent>> {
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
