//! An in-process stand-in for the kubelet's device manager, over real Unix sockets.
//!
//! It behaves as the real kubelet does where a plugin can tell: it deletes every socket in the
//! directory when it starts, answers `Register` only after dialling the plugin back and asking
//! for its options (so a plugin that cannot serve during its own `Register` call deadlocks here
//! too), opens ListAndWatch from a separate task, treats every message as a full snapshot, never
//! redials, and marks every device unhealthy when the stream ends. The demo and the tests use it.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::config::validate_resource_name;
use crate::proto::deviceplugin::{
    Device, DevicePluginOptions, Empty, HEALTHY, KUBELET_SOCKET, RegisterRequest, UNHEALTHY,
    VERSION, device_plugin_client::DevicePluginClient, registration_server::Registration,
    registration_server::RegistrationServer,
};
use crate::uds;

const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// The real kubelet waits forever for the options; a hang here means the plugin deadlocked.
const OPTIONS_WATCHDOG: Duration = Duration::from_secs(5);

/// What the stand-in kubelet knows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KubeletView {
    /// Register calls received, accepted or not.
    pub register_calls: u64,
    pub last_request: Option<RegisterRequest>,
    pub options: Option<DevicePluginOptions>,
    /// The latest snapshot from ListAndWatch; all Unhealthy once the stream ended.
    pub devices: Vec<Device>,
    pub stream_open: bool,
    /// ListAndWatch streams opened so far; only the newest one updates the view.
    pub streams_started: u64,
    pub snapshots: u64,
    pub last_error: Option<String>,
}

impl KubeletView {
    pub fn healthy(&self) -> usize {
        self.devices.iter().filter(|d| d.health == HEALTHY).count()
    }

    pub fn health_of(&self, id: &str) -> Option<&str> {
        self.device(id).map(|d| d.health.as_str())
    }

    /// The first NUMA node the device's topology names.
    pub fn numa_of(&self, id: &str) -> Option<i64> {
        self.device(id)?
            .topology
            .as_ref()?
            .nodes
            .first()
            .map(|n| n.id)
    }

    fn device(&self, id: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.id == id)
    }
}

#[derive(Clone, Default)]
struct Shared {
    view: Arc<watch::Sender<KubeletView>>,
    plugin: Arc<Mutex<Option<DevicePluginClient<Channel>>>>,
    stream: Arc<Mutex<Option<CancellationToken>>>,
    reject_streams: Arc<AtomicBool>,
    /// While set, Register is refused with this message before dialling back.
    refusal: Arc<Mutex<Option<String>>>,
    /// While set, Register succeeds but no ListAndWatch stream is opened, as when the real
    /// kubelet's stream call fails after it accepted the registration.
    no_streams: Arc<AtomicBool>,
}

pub struct KubeletStub {
    dir: PathBuf,
    shared: Shared,
    server: Option<(
        CancellationToken,
        JoinHandle<Result<(), tonic::transport::Error>>,
    )>,
}

impl KubeletStub {
    /// Starts serving `<dir>/kubelet.sock`, after deleting every socket in `dir`.
    pub fn start(dir: &Path) -> std::io::Result<Self> {
        let mut stub = KubeletStub {
            dir: dir.to_owned(),
            shared: Shared::default(),
            server: None,
        };
        stub.listen()?;
        Ok(stub)
    }

    fn listen(&mut self) -> std::io::Result<()> {
        let socket = self.bind()?;
        self.serve(uds::listen(socket)?);
        Ok(())
    }

    /// Creates `kubelet.sock`, not listening yet.
    fn bind(&self) -> std::io::Result<OwnedFd> {
        std::fs::create_dir_all(&self.dir)?;
        remove_sockets(&self.dir)?;
        uds::bind_unlistened(&self.dir.join(KUBELET_SOCKET))
    }

    fn serve(&mut self, listener: UnixListener) {
        let stop = CancellationToken::new();
        let handler = Handler {
            dir: self.dir.clone(),
            shared: self.shared.clone(),
            stopped: stop.clone(),
        };
        let task = uds::spawn_server(listener, RegistrationServer::new(handler), stop.clone());
        self.server = Some((stop, task));
    }

    pub fn view(&self) -> watch::Receiver<KubeletView> {
        self.shared.view.subscribe()
    }

    /// Waits until the view satisfies `done`, or fails with the last view after `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&KubeletView) -> bool,
    ) -> Result<KubeletView, KubeletView> {
        let mut view = self.view();
        let waited = tokio::time::timeout(timeout, async {
            view.wait_for(|v| done(v)).await.map(|v| v.clone())
        })
        .await;
        match waited {
            Ok(Ok(v)) => Ok(v),
            _ => Err(self.shared.view.borrow().clone()),
        }
    }

    /// The connection to the registered plugin, as the kubelet uses it for Allocate.
    pub fn plugin(&self) -> Option<DevicePluginClient<Channel>> {
        lock(&self.shared.plugin).clone()
    }

    /// Ends the current ListAndWatch stream from the kubelet's side.
    pub fn end_stream(&self) {
        if let Some(stream) = lock(&self.shared.stream).take() {
            stream.cancel();
        }
    }

    /// Restarts as the kubelet does: drop connections, delete every socket, serve a new
    /// `kubelet.sock`. The device list is empty until the plugin registers again.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.restart_listening_after(Duration::ZERO).await
    }

    /// [`Self::restart`] with the kubelet down for `down` first, as a real one is while its
    /// process starts: a plugin that serves its socket again meanwhile loses it to the cleanup.
    pub async fn restart_after(&mut self, down: Duration) -> std::io::Result<()> {
        self.shutdown().await;
        tokio::time::sleep(down).await;
        self.restart().await
    }

    /// [`Self::restart`] with `gap` between creating `kubelet.sock` and listening on it: the
    /// kubelet's Go runtime binds and listens in two steps, and a connect in between is refused.
    pub async fn restart_listening_after(&mut self, gap: Duration) -> std::io::Result<()> {
        self.shutdown().await;
        self.shared.view.send_modify(|v| {
            v.devices.clear();
            v.options = None;
        });
        let socket = self.bind()?;
        tokio::time::sleep(gap).await;
        self.serve(uds::listen(socket)?);
        Ok(())
    }

    /// While set, every ListAndWatch stream is ended after its first message, as the kubelet
    /// does with a device list over its message size limit.
    pub fn reject_streams(&self, reject: bool) {
        self.shared.reject_streams.store(reject, Ordering::Relaxed);
    }

    /// While `Some`, every Register is refused with that message.
    pub fn refuse_registrations(&self, message: Option<&str>) {
        *lock(&self.shared.refusal) = message.map(str::to_owned);
    }

    /// While set, Register succeeds (after the dial back) but opens no ListAndWatch stream.
    pub fn open_no_streams(&self, none: bool) {
        self.shared.no_streams.store(none, Ordering::Relaxed);
    }

    async fn shutdown(&mut self) {
        self.end_stream();
        lock(&self.shared.plugin).take();
        if let Some((stop, task)) = self.server.take() {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
        }
    }

    /// Stops serving and deletes `kubelet.sock`, as a node whose kubelet has not started yet:
    /// [`Self::restart`] starts it.
    pub async fn power_off(&mut self) {
        self.shutdown().await;
        let _ = std::fs::remove_file(self.dir.join(KUBELET_SOCKET));
    }

    /// Stops serving and deletes `kubelet.sock`.
    pub async fn stop(mut self) {
        self.power_off().await;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The kubelet dials the plugin back with gRPC's blocking dial, which retries a missing or
/// refusing socket until the deadline, so Register hangs while the plugin's socket is gone.
async fn dial_until_up(socket: &Path) -> Channel {
    loop {
        if let Ok(channel) = uds::dial(socket).await {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The kubelet's start-up cleanup: every socket goes, other files and dirs stay.
fn remove_sockets(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    for entry in std::fs::read_dir(dir)?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_socket()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

struct Handler {
    dir: PathBuf,
    shared: Shared,
    /// This instance's stop: a kubelet that exits drops its connections, so a Register still
    /// in flight then fails at once instead of living on beside the next instance.
    stopped: CancellationToken,
}

impl Handler {
    fn refuse(&self, message: String) -> Status {
        self.shared
            .view
            .send_modify(|v| v.last_error = Some(message.clone()));
        Status::unknown(message)
    }

    async fn answer(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        self.shared.view.send_modify(|v| {
            v.register_calls += 1;
            v.last_request = Some(request.clone());
        });
        if let Some(message) = lock(&self.shared.refusal).clone() {
            return Err(self.refuse(message));
        }
        if request.version != VERSION {
            return Err(self.refuse(format!(
                "requested API version {:?} is not supported by kubelet. Supported version is [\"{VERSION}\"]",
                request.version
            )));
        }
        if validate_resource_name(&request.resource_name).is_err() {
            return Err(self.refuse(format!(
                "the ResourceName {:?} is invalid",
                request.resource_name
            )));
        }
        let socket = self.dir.join(&request.endpoint);
        let Ok(channel) = tokio::time::timeout(DIAL_TIMEOUT, dial_until_up(&socket)).await else {
            return Err(self.refuse("failed to dial device plugin: timed out".into()));
        };
        let mut client = DevicePluginClient::new(channel);
        let options = match tokio::time::timeout(
            OPTIONS_WATCHDOG,
            client.get_device_plugin_options(Empty {}),
        )
        .await
        {
            Ok(Ok(options)) => options.into_inner(),
            Ok(Err(status)) => {
                return Err(self.refuse(format!("failed to get device plugin options: {status}")));
            }
            Err(_) => {
                return Err(self.refuse(
                    "GetDevicePluginOptions did not answer while Register was in flight (deadlock)"
                        .into(),
                ));
            }
        };
        if self.shared.no_streams.load(Ordering::Relaxed) {
            self.shared.view.send_modify(|v| {
                v.options = Some(options);
                v.last_error = None;
            });
            return Ok(Response::new(Empty {}));
        }
        *lock(&self.shared.plugin) = Some(client.clone());
        let stream_stop = CancellationToken::new();
        *lock(&self.shared.stream) = Some(stream_stop.clone());
        let mut generation = 0;
        self.shared.view.send_modify(|v| {
            v.options = Some(options);
            v.last_error = None;
            v.streams_started += 1;
            generation = v.streams_started;
        });
        tokio::spawn(consume_stream(
            client,
            stream_stop,
            self.shared.clone(),
            generation,
        ));
        Ok(Response::new(Empty {}))
    }
}

#[tonic::async_trait]
impl Registration for Handler {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        tokio::select! {
            () = self.stopped.cancelled() => Err(Status::unavailable("the kubelet stopped")),
            answer = self.answer(request) => answer,
        }
    }
}

async fn consume_stream(
    mut client: DevicePluginClient<Channel>,
    stop: CancellationToken,
    shared: Shared,
    generation: u64,
) {
    let view = &shared.view;
    let update = |change: &dyn Fn(&mut KubeletView)| {
        view.send_if_modified(|v| {
            let current = v.streams_started == generation;
            if current {
                change(v);
            }
            current
        });
    };
    if let Ok(response) = client.list_and_watch(Empty {}).await {
        let mut stream = response.into_inner();
        update(&|v| v.stream_open = true);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                message = stream.message() => match message {
                    Ok(Some(list)) => {
                        update(&|v| {
                            v.devices = list.devices.clone();
                            v.snapshots += 1;
                        });
                        if shared.reject_streams.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    _ => break,
                },
            }
        }
    }
    update(&|v| {
        v.stream_open = false;
        for device in &mut v.devices {
            device.health = UNHEALTHY.into();
        }
    });
}
