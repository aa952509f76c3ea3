//! Readiness for a service manager that started the plugin on the host (systemd's
//! `Type=notify`, the unit in `manifests/systemd`): the kubelet, ordered after the plugin, starts
//! only once the plugin would register with it at once.
//!
//! The protocol is sd_notify(3)'s: one datagram of `KEY=VALUE` lines to the Unix socket named by
//! `NOTIFY_SOCKET` (a path, or an abstract name after `@`). It is a few lines over std's
//! `UnixDatagram`, so no crate (and no libsystemd) is linked for it. Without `NOTIFY_SOCKET` (a
//! pod, a shell) nothing is sent and the plugin behaves as it always has.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;

use tokio_util::sync::CancellationToken;

use crate::state::{Reader, Registration};

/// The variable a service manager names its notification socket in.
const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Where the service manager listens for the plugin's state.
#[derive(Debug, Clone)]
pub(crate) struct Notifier {
    address: SocketAddr,
}

impl Notifier {
    /// The service manager's socket, if one started the plugin; an unusable name is logged and
    /// read as none, so a stray variable never stops the plugin.
    pub(crate) fn from_env() -> Option<Notifier> {
        let name = std::env::var_os(NOTIFY_SOCKET)?;
        match Notifier::new(&name.to_string_lossy()) {
            Ok(notifier) => Some(notifier),
            Err(err) => {
                tracing::warn!(error = %err, variable = NOTIFY_SOCKET, "not telling the service manager the plugin's state");
                None
            }
        }
    }

    fn new(name: &str) -> io::Result<Notifier> {
        let address = match name.strip_prefix('@') {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(abstract_name)?
            }
            None if name.starts_with('/') => SocketAddr::from_pathname(Path::new(name))?,
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{name:?} is neither an absolute path nor an abstract name"),
                ));
            }
        };
        Ok(Notifier { address })
    }

    fn send(&self, state: &str) -> io::Result<()> {
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &self.address)?;
        Ok(())
    }
}

/// Sends `READY=1` once the lifecycle listens for the kubelet (the first scan is done by then,
/// and in cdi mode the first spec written), and `STOPPING=1` at shutdown. Runs until shutdown.
pub(crate) async fn announce(
    notifier: Notifier,
    registration: Reader<Registration>,
    shutdown: CancellationToken,
) {
    let mut changes = registration.subscribe();
    let listening = async {
        changes
            .wait_for(|r| r.listening || r.registered)
            .await
            .is_ok()
    };
    let ready = tokio::select! {
        _ = shutdown.cancelled() => false,
        ready = listening => ready,
    };
    if ready {
        tell(&notifier, "READY=1\nSTATUS=listening for the kubelet");
        shutdown.cancelled().await;
    }
    tell(&notifier, "STOPPING=1");
}

/// A failed notice is logged, never fatal: the service manager then stops a start that never
/// says ready after its own timeout, as it would for any other cause.
fn tell(notifier: &Notifier, state: &str) {
    match notifier.send(state) {
        Ok(()) => tracing::info!(state, "told the service manager"),
        Err(err) => tracing::warn!(error = %err, state, "cannot tell the service manager"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Writer;
    use std::time::Duration;

    fn listener() -> (tempfile::TempDir, UnixDatagram, Notifier) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let notifier = Notifier::new(path.to_str().unwrap()).unwrap();
        (dir, socket, notifier)
    }

    fn received(socket: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let n = socket.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[tokio::test]
    async fn ready_waits_for_the_lifecycle_to_listen_and_stopping_follows_shutdown() {
        let (_dir, socket, notifier) = listener();
        let registration = Writer::<Registration>::default();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(announce(notifier, registration.reader(), shutdown.clone()));
        // One runtime thread: the task runs to its wait before the test goes on.
        tokio::task::yield_now().await;
        registration.send_modify(|r| r.registrations = 0);
        tokio::task::yield_now().await;
        socket.set_nonblocking(true).unwrap();
        let early = socket.recv(&mut [0u8; 64]).map_err(|e| e.kind());
        assert_eq!(
            early,
            Err(io::ErrorKind::WouldBlock),
            "nothing before the lifecycle listens"
        );
        socket.set_nonblocking(false).unwrap();

        registration.send_modify(|r| r.listening = true);
        tokio::task::yield_now().await;
        assert_eq!(
            received(&socket),
            "READY=1\nSTATUS=listening for the kubelet"
        );
        shutdown.cancel();
        task.await.unwrap();
        assert_eq!(received(&socket), "STOPPING=1");
    }

    #[tokio::test]
    async fn a_shutdown_before_ready_says_only_stopping() {
        let (_dir, socket, notifier) = listener();
        let registration = Writer::<Registration>::default();
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        announce(notifier, registration.reader(), shutdown).await;
        assert_eq!(received(&socket), "STOPPING=1");
    }

    #[test]
    fn abstract_names_and_paths_are_read_and_anything_else_is_refused() {
        assert!(Notifier::new("@/org/freedesktop/systemd1/notify").is_ok());
        assert!(Notifier::new("/run/systemd/notify").is_ok());
        let err = Notifier::new("run/notify").unwrap_err();
        assert!(
            err.to_string().contains("neither an absolute path"),
            "{err}"
        );
    }
}
