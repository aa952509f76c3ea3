//! Registration with the kubelet, kept alive across everything the kubelet does.
//!
//! The kubelet never redials a plugin: when it restarts it deletes every socket in the
//! device-plugin dir and creates a new `kubelet.sock`, and when a ListAndWatch stream ends it
//! only marks the devices unhealthy. So the plugin re-registers on its own, each time stopping
//! the old server first (ending its streams) and serving a fresh socket before calling
//! `Register`, because the kubelet dials back and asks for the plugin's options while that call
//! is still in flight. Changes are seen through inotify on the directory, not by polling.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::allocation::Allocator;
use crate::fswatch::{DirEvent, DirWatch};
use crate::proto::deviceplugin::{
    KUBELET_SOCKET, RegisterRequest, VERSION, device_plugin_server::DevicePluginServer,
    registration_client::RegistrationClient,
};
use crate::service::{PluginService, StreamHooks};
use crate::state::DeviceState;
use crate::uds::{self, FileIdentity};

/// File name of the plugin's socket inside the device-plugin dir.
pub const PLUGIN_SOCKET: &str = "efa-device-plugin.sock";

/// A kubelet that accepted the connection but hangs in Register is retried after this long.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound for the time a stopping server may take to close its connections.
const STOP_TIMEOUT: Duration = Duration::from_secs(1);
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);

/// What the rest of the process may know about the registration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginStatus {
    pub registered: bool,
    pub open_streams: usize,
    pub registrations: u64,
    pub kubelet_restarts: u64,
}

/// Why a registration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    SocketReplaced,
    KubeletSocketReplaced,
    StreamEnded,
    Shutdown,
}

pub struct Lifecycle {
    pub dir: PathBuf,
    pub resource_name: String,
    pub state: DeviceState,
    pub allocator: Arc<Allocator>,
    pub status: Arc<watch::Sender<PluginStatus>>,
}

enum Attempt {
    Registered(Generation),
    Failed(anyhow::Error),
    Shutdown,
}

/// One served socket and its server task.
struct Generation {
    stop: CancellationToken,
    hooks: Arc<StreamHooks>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    socket: PathBuf,
    identity: Option<FileIdentity>,
    status_relay: JoinHandle<()>,
}

impl Generation {
    async fn stop(self) {
        self.stop.cancel();
        let mut server = self.server;
        match tokio::time::timeout(STOP_TIMEOUT, &mut server).await {
            Ok(Ok(Err(err))) => tracing::error!(error = %err, "plugin gRPC server failed"),
            Ok(_) => {}
            Err(_) => server.abort(),
        }
        self.status_relay.abort();
        // Remove the socket only if it is still ours: the kubelet may already have deleted it,
        // and nothing else may be put at that path in between.
        if self.identity.is_some() && uds::identity(&self.socket) == self.identity {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

impl Lifecycle {
    fn kubelet_socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    fn plugin_socket(&self) -> PathBuf {
        self.dir.join(PLUGIN_SOCKET)
    }

    /// Runs until `shutdown`; the plugin's socket is removed before it returns.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Some(mut watch) = self.watch_dir(&shutdown).await else {
            return Ok(());
        };
        let mut retry = FIRST_RETRY;
        let mut last_kubelet: Option<FileIdentity> = None;
        let mut waiting_logged = false;
        loop {
            if watch.is_dead() {
                match self.watch_dir(&shutdown).await {
                    Some(fresh) => watch = fresh,
                    None => return Ok(()),
                }
            }
            let kubelet = uds::identity(&self.kubelet_socket());
            if kubelet.is_none() {
                if !waiting_logged {
                    tracing::info!(socket = %self.kubelet_socket().display(), "waiting for the kubelet");
                    waiting_logged = true;
                }
                if !self.wait_for_kubelet(&mut watch, None, &shutdown).await {
                    return Ok(());
                }
                continue;
            }
            waiting_logged = false;
            let generation = match self.attempt(&shutdown).await {
                Attempt::Registered(generation) => generation,
                Attempt::Shutdown => return Ok(()),
                Attempt::Failed(err) => {
                    tracing::warn!(error = %format!("{err:#}"), retry_in = ?retry, "registration with the kubelet failed");
                    if !self
                        .wait_for_kubelet(&mut watch, Some(retry), &shutdown)
                        .await
                    {
                        return Ok(());
                    }
                    retry = (retry * 2).min(LAST_RETRY);
                    continue;
                }
            };
            retry = FIRST_RETRY;
            let restarted = last_kubelet.is_some_and(|last| Some(last) != kubelet);
            last_kubelet = kubelet;
            self.status.send_modify(|s| {
                s.registered = true;
                s.registrations += 1;
                s.kubelet_restarts += u64::from(restarted);
            });
            tracing::info!(
                resource = %self.resource_name,
                endpoint = PLUGIN_SOCKET,
                kubelet_restarted = restarted,
                devices = self.state.current().devices().len(),
                "registered with the kubelet"
            );

            let ended = self
                .wait_until_ended(&generation, &mut watch, kubelet, &shutdown)
                .await;
            self.status.send_modify(|s| s.registered = false);
            generation.stop().await;
            match ended {
                Ending::Shutdown => return Ok(()),
                reason => tracing::info!(reason = ?reason, "registration ended; registering again"),
            }
        }
    }

    /// Sets up the inotify watch on the device-plugin dir, creating the dir like the kubelet
    /// would. Retries until it works: a missing or unreadable dir is not a reason to exit.
    async fn watch_dir(&self, shutdown: &CancellationToken) -> Option<DirWatch> {
        let mut logged = false;
        loop {
            let attempt = std::fs::create_dir_all(&self.dir)
                .and_then(|()| DirWatch::new(&self.dir))
                .with_context(|| format!("device-plugin dir {}", self.dir.display()));
            match attempt {
                Ok(watch) => return Some(watch),
                Err(err) if !logged => {
                    tracing::error!(error = %format!("{err:#}"), "cannot watch the device-plugin dir; retrying");
                    logged = true;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(LAST_RETRY) => {}
            }
        }
    }

    /// Serves a fresh socket and registers it; a failed attempt leaves no server behind.
    async fn attempt(&self, shutdown: &CancellationToken) -> Attempt {
        let generation = match self.serve() {
            Ok(generation) => generation,
            Err(err) => return Attempt::Failed(err.context("cannot serve the plugin socket")),
        };
        let registered = tokio::select! {
            _ = shutdown.cancelled() => {
                generation.stop().await;
                return Attempt::Shutdown;
            }
            result = tokio::time::timeout(REGISTER_TIMEOUT, self.register()) => {
                result.unwrap_or_else(|_| Err(anyhow::anyhow!("Register timed out after {REGISTER_TIMEOUT:?}")))
            }
        };
        match registered {
            Ok(()) => Attempt::Registered(generation),
            Err(err) => {
                generation.stop().await;
                Attempt::Failed(err)
            }
        }
    }

    fn serve(&self) -> anyhow::Result<Generation> {
        let socket = self.plugin_socket();
        let listener =
            uds::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
        let identity = uds::identity(&socket);
        let stop = CancellationToken::new();
        let hooks = Arc::new(StreamHooks::default());
        let service = PluginService {
            devices: self.state.subscribe(),
            allocator: self.allocator.clone(),
            hooks: hooks.clone(),
            stop: stop.clone(),
        };
        let server = uds::spawn_server(listener, DevicePluginServer::new(service), stop.clone());
        let status_relay = tokio::spawn({
            let mut open = hooks.open_streams();
            let status = self.status.clone();
            async move {
                loop {
                    let count = *open.borrow_and_update();
                    status.send_if_modified(|s| {
                        std::mem::replace(&mut s.open_streams, count) != count
                    });
                    if open.changed().await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Generation {
            stop,
            hooks,
            server,
            socket,
            identity,
            status_relay,
        })
    }

    async fn register(&self) -> anyhow::Result<()> {
        let channel = uds::dial(&self.kubelet_socket())
            .await
            .context("connecting to kubelet.sock")?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.into(),
                endpoint: PLUGIN_SOCKET.into(),
                resource_name: self.resource_name.clone(),
                options: None,
            })
            .await
            .map_err(|status| anyhow::anyhow!("kubelet refused Register: {}", status.message()))?;
        Ok(())
    }

    /// Waits until `kubelet.sock` is (re)created, or `timeout` passes. Returns false on shutdown.
    async fn wait_for_kubelet(
        &self,
        watch: &mut DirWatch,
        timeout: Option<Duration>,
        shutdown: &CancellationToken,
    ) -> bool {
        let deadline = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = &mut deadline => return true,
                events = watch.next() => match events {
                    Ok(events) if !events.iter().any(|e| e.is_about(KUBELET_SOCKET) && is_creation(e)) => {}
                    _ => return true,
                },
            }
        }
    }

    async fn wait_until_ended(
        &self,
        generation: &Generation,
        watch: &mut DirWatch,
        kubelet: Option<FileIdentity>,
        shutdown: &CancellationToken,
    ) -> Ending {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ending::Shutdown,
                _ = generation.hooks.ended_by_kubelet() => return Ending::StreamEnded,
                events = watch.next() => {
                    if events.is_err() {
                        return Ending::SocketReplaced;
                    }
                    // Level-triggered: whatever the events said, compare what is there now.
                    if uds::identity(&generation.socket) != generation.identity {
                        return Ending::SocketReplaced;
                    }
                    let now = uds::identity(&self.kubelet_socket());
                    if now.is_some() && now != kubelet {
                        return Ending::KubeletSocketReplaced;
                    }
                }
            }
        }
    }
}

fn is_creation(event: &DirEvent) -> bool {
    use nix::sys::inotify::AddWatchFlags;
    event
        .mask
        .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
}
