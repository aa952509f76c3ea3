//! Other device plugins for this resource on the node, such as the AWS plugin.
//!
//! The kubelet keeps one plugin per resource name: each `Register` replaces the endpoint before
//! it. Kubelets up to 1.36 leave the replaced plugin's stream open, but when either plugin's
//! connection drops they deregister the resource by name, ending the survivor's stream too
//! (kubernetes#121994). Two plugins that both register again whenever their stream ends would
//! take the resource from each other. So while a listed socket in the device-plugin dir accepts
//! connections, its plugin is reported and this one does not take the resource back; a stale
//! socket file that refuses connections is no competitor.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::rescan::Rescans;
use crate::state::PluginStatus;

/// A connect to a live plugin's socket completes at once; one that does not is no answer.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

pub(crate) struct Watch {
    pub dir: PathBuf,
    pub sockets: Vec<String>,
    /// How often to look again without a change in the dir.
    pub interval: Duration,
    pub status: Arc<watch::Sender<PluginStatus>>,
}

/// The first of `sockets` in `dir` that is a socket accepting connections.
pub(crate) fn find(dir: &Path, sockets: &[String]) -> Option<String> {
    sockets
        .iter()
        .find(|name| {
            let path = dir.join(name);
            std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket())
                && std::os::unix::net::UnixStream::connect(&path).is_ok()
        })
        .cloned()
}

impl Watch {
    /// Looks once and records the outcome in the status; logs when a competitor appears or goes.
    pub(crate) async fn refresh(&self) {
        let (dir, sockets) = (self.dir.clone(), self.sockets.clone());
        let probe = tokio::task::spawn_blocking(move || find(&dir, &sockets));
        let found = match tokio::time::timeout(PROBE_DEADLINE, probe).await {
            Ok(Ok(found)) => found,
            // A panic, or a socket whose connect hangs: the last verdict stands.
            Ok(Err(err)) => {
                tracing::error!(error = %err, "looking for competing plugins failed");
                return;
            }
            Err(_) => return,
        };
        let before = self.status.borrow().competitor.clone();
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
        self.status
            .send_modify(|status| status.competitor = found.clone());
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

    #[test]
    fn only_a_listed_socket_that_accepts_counts() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["aws-efa-device-plugin.sock".to_owned()];
        let path = dir.path().join(&names[0]);
        assert_eq!(find(dir.path(), &names), None, "absent");
        std::fs::write(&path, "").unwrap();
        assert_eq!(find(dir.path(), &names), None, "a regular file");
        std::fs::remove_file(&path).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert_eq!(find(dir.path(), &names).as_deref(), Some(names[0].as_str()));
        let other = std::os::unix::net::UnixListener::bind(dir.path().join("other.sock")).unwrap();
        drop(listener);
        assert_eq!(find(dir.path(), &names), None, "stale: refuses connections");
        drop(other);
    }
}
