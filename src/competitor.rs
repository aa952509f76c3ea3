//! Other device plugins for this resource on the node, such as the AWS plugin.
//!
//! The kubelet keeps one plugin per resource name: each `Register` replaces the endpoint before
//! it. Kubelets up to 1.36 leave the replaced plugin's stream open, but when either plugin's
//! connection drops they deregister the resource by name, ending the survivor's stream too
//! (kubernetes#121994). Two plugins that both register again whenever their stream ends would
//! take the resource from each other. So while a listed socket in the device-plugin dir accepts
//! connections, its plugin is reported and this one does not take the resource back; a stale
//! socket file that refuses connections is no competitor. A frozen plugin, listening but no
//! longer accepting, proves neither: the last verdict stands.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;

use crate::rescan::Rescans;
use crate::state::{Competition, Writer};

/// A connect to a Unix socket completes or fails at once; this bounds one that would not.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

pub(crate) struct Watch {
    pub dir: PathBuf,
    pub sockets: Vec<String>,
    /// How often to look again without a change in the dir.
    pub interval: Duration,
    pub competition: Writer<Competition>,
}

/// A listed socket that neither accepts nor refuses: one listening whose backlog is full, as a
/// frozen plugin's is once it stops accepting.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Undecided(String);

/// The first of `sockets` in `dir` that accepts connections, `None` if each is absent or
/// refuses (a stale socket file, or no socket at all), or [`Undecided`] if none accepts and one
/// is listening with a full backlog.
///
/// Each connect is non-blocking, on the runtime thread: a blocking one hangs on a full backlog,
/// and a thread abandoned to it per pass would fill the blocking pool that the rest of the
/// plugin needs. So no pass leaves anything behind, and one pass is in flight at a time.
pub(crate) async fn find(dir: &Path, sockets: &[String]) -> Result<Option<String>, Undecided> {
    let mut undecided = None;
    for name in sockets {
        match tokio::time::timeout(PROBE_DEADLINE, UnixStream::connect(dir.join(name))).await {
            Ok(Ok(_)) => return Ok(Some(name.clone())),
            // EAGAIN: Linux refuses a non-blocking connect at once when the backlog is full.
            Ok(Err(err)) if err.kind() == ErrorKind::WouldBlock => {
                undecided.get_or_insert_with(|| name.clone());
            }
            Err(_) => {
                undecided.get_or_insert_with(|| name.clone());
            }
            // Absent, not a socket (refused), or a socket nobody listens on.
            Ok(Err(_)) => {}
        }
    }
    undecided.map_or(Ok(None), |name| Err(Undecided(name)))
}

impl Watch {
    /// Looks once and records the outcome; logs when a competitor appears or goes.
    pub(crate) async fn refresh(&self) {
        let found = match find(&self.dir, &self.sockets).await {
            Ok(found) => found,
            // Neither alive nor gone: the last verdict stands.
            Err(Undecided(socket)) => {
                tracing::debug!(socket, "a competing plugin's socket accepts no connections");
                return;
            }
        };
        let before = self.competition.borrow().socket.clone();
        if before == found {
            return;
        }
        match &found {
            Some(socket) => tracing::error!(
                socket = %self.dir.join(socket).display(),
                "another device plugin serves this resource; the kubelet keeps whichever registered last, \
                 and this plugin will not take the resource back while it runs (uninstall one of them)"
            ),
            None => tracing::info!(
                socket = before.as_deref().unwrap_or_default(),
                "the competing device plugin is gone"
            ),
        }
        self.competition
            .send_modify(|competition| competition.socket = found);
    }

    /// Looks again on every change of the dir, and every `interval` in any case.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        if self.sockets.is_empty() {
            return shutdown.cancelled().await;
        }
        let mut rescans = Rescans::every(self.interval, shutdown).watching(self.dir.clone());
        while rescans.due().await {
            self.refresh().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frozen::FrozenSocket;

    #[tokio::test]
    async fn only_a_listed_socket_that_accepts_counts() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["aws-efa-device-plugin.sock".to_owned()];
        let path = dir.path().join(&names[0]);
        assert_eq!(find(dir.path(), &names).await, Ok(None), "absent");
        std::fs::write(&path, "").unwrap();
        assert_eq!(find(dir.path(), &names).await, Ok(None), "a regular file");
        std::fs::remove_file(&path).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(find(dir.path(), &names).await, Ok(Some(names[0].clone())));
        let other = std::os::unix::net::UnixListener::bind(dir.path().join("other.sock")).unwrap();
        drop(listener);
        assert_eq!(
            find(dir.path(), &names).await,
            Ok(None),
            "stale: refuses connections"
        );
        drop(other);
    }

    #[tokio::test(start_paused = true)]
    async fn a_frozen_competitor_leaves_the_verdict_and_costs_no_wait() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["aws-efa-device-plugin.sock".to_owned()];
        let _frozen = FrozenSocket::bind(&dir.path().join(&names[0])).unwrap();
        let watch = Watch {
            dir: dir.path().to_owned(),
            sockets: names.to_vec(),
            interval: Duration::from_secs(1),
            competition: Writer::new(Competition {
                socket: Some(names[0].clone()),
            }),
        };
        let started = tokio::time::Instant::now();
        for _ in 0..1000 {
            watch.refresh().await;
        }
        // A probe that waited for its deadline would have moved the paused clock.
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(
            watch.competition.borrow().socket.as_deref(),
            Some(names[0].as_str()),
            "the last verdict stands"
        );
        assert_eq!(
            find(dir.path(), &names).await,
            Err(Undecided(names[0].clone()))
        );
        // One listed socket that accepts still counts, whatever the frozen one does.
        let both = [names[0].clone(), "other.sock".to_owned()];
        let _other = std::os::unix::net::UnixListener::bind(dir.path().join(&both[1])).unwrap();
        assert_eq!(find(dir.path(), &both).await, Ok(Some(both[1].clone())));
    }
}
