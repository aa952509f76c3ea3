//! The `DevicePlugin` gRPC service: translation between the wire and the plugin's state.
//!
//! Device state is read from [`crate::state`], allocation decided by [`crate::allocation`];
//! nothing here owns data. One service instance lives for one registration generation.

use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use hyper::body::Frame;
use prost::bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::{Notify, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use crate::allocation::sharing::Sharing;
use crate::allocation::{AllocateError, Allocator};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo, UNHEALTHY,
    device_plugin_server::{DevicePlugin, DevicePluginServer, SERVICE_NAME},
};
use crate::state::{DeviceReader, DeviceRecord, Inventory};
use crate::uds::ConnectionId;

/// What the lifecycle learns from the streams of one generation.
///
/// Which stream is the kubelet's follows from how the kubelet registers a plugin (1.26 on,
/// `devicemanager/plugin/v1beta1`): inside its `Register` handler it dials the plugin's socket
/// (`client.Connect`), asks that connection for `GetDevicePluginOptions`, and only then starts
/// `runClient`, which opens ListAndWatch over the same connection. So the kubelet's stream is
/// the first one on a connection that asked for the options while the plugin's `Register` call
/// was in flight. A stream of another client (a debugging tool, a second reader), even one
/// opened at the same instant, comes over a connection of its own and is never taken for it.
#[derive(Default)]
pub(crate) struct StreamHooks {
    open: watch::Sender<usize>,
    /// Whether the kubelet's stream has opened; at most one stream is.
    kubelet_stream: watch::Sender<bool>,
    dial_back: Mutex<DialBack>,
    /// Signalled when the kubelet ends its stream (rather than the plugin stopping it).
    ended_by_kubelet: Notify,
}

/// The connections that asked for the options while Register was in flight: the kubelet's
/// dial-back among them.
#[derive(Default)]
struct DialBack {
    in_flight: bool,
    connections: Vec<ConnectionId>,
}

/// More connections asking for the options within the milliseconds of one Register than a
/// node has any reason for; past this, the kubelet's may go unrecognised, which costs one
/// registration (no stream seen), not a wrong verdict.
const MAX_DIAL_BACKS: usize = 16;

impl StreamHooks {
    pub(crate) fn open_streams(&self) -> watch::Receiver<usize> {
        self.open.subscribe()
    }

    /// True once the kubelet's stream has opened.
    pub(crate) fn kubelet_stream(&self) -> watch::Receiver<bool> {
        self.kubelet_stream.subscribe()
    }

    /// Called just before Register is sent: the kubelet dials back from now on.
    pub(crate) fn registering(&self) {
        self.dial_back().in_flight = true;
    }

    /// Called once Register has returned: the kubelet asked for the options before answering
    /// it, so a connection asking from now on is not the kubelet's.
    pub(crate) fn registered(&self) {
        self.dial_back().in_flight = false;
    }

    pub(crate) async fn ended_by_kubelet(&self) {
        self.ended_by_kubelet.notified().await
    }

    fn dial_back(&self) -> std::sync::MutexGuard<'_, DialBack> {
        self.dial_back.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn options_asked(&self, connection: Option<ConnectionId>) {
        let mut dial_back = self.dial_back();
        if let Some(connection) = connection
            && dial_back.in_flight
            && dial_back.connections.len() < MAX_DIAL_BACKS
            && !dial_back.connections.contains(&connection)
        {
            dial_back.connections.push(connection);
        }
    }

    fn claim_kubelet_stream(&self, connection: Option<ConnectionId>) -> bool {
        connection.is_some_and(|c| self.dial_back().connections.contains(&c))
            && self
                .kubelet_stream
                .send_if_modified(|opened| !std::mem::replace(opened, true))
    }
}

/// Counts a stream as open while alive, and reports how the kubelet's stream ended.
struct StreamGuard {
    hooks: Arc<StreamHooks>,
    stop: CancellationToken,
    kubelets: bool,
}

impl StreamGuard {
    fn new(
        hooks: Arc<StreamHooks>,
        stop: CancellationToken,
        connection: Option<ConnectionId>,
    ) -> Self {
        hooks.open.send_modify(|n| *n += 1);
        let kubelets = hooks.claim_kubelet_stream(connection);
        StreamGuard {
            hooks,
            stop,
            kubelets,
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.hooks.open.send_modify(|n| *n -= 1);
        if self.kubelets && !self.stop.is_cancelled() {
            self.hooks.ended_by_kubelet.notify_one();
        }
    }
}

/// The service of one generation; [`server`] makes the gRPC server that answers for it.
pub(crate) struct PluginService {
    pub devices: DeviceReader,
    pub allocator: Arc<Allocator>,
    pub hooks: Arc<StreamHooks>,
    /// Cancelled when this generation stops: streams end, so the server can shut down.
    pub stop: CancellationToken,
}

/// Every advertised ID of the snapshot as the kubelet sees it, with its EFA's health and NUMA
/// node, one at a time: the list is only ever held encoded.
fn advertised(inventory: &Inventory, sharing: Sharing) -> impl Iterator<Item = Device> + '_ {
    inventory.devices().flat_map(move |record| {
        sharing
            .advertised(&record.efa.id)
            .map(move |id| to_device(id, record))
    })
}

/// The `devices` field (1) of a `ListAndWatchResponse`, one device at a time.
fn encoded_len(devices: impl Iterator<Item = Device>) -> usize {
    devices
        .map(|device| prost::encoding::message::encoded_len(1, &device))
        .sum()
}

/// The device list of `inventory` as one gRPC message frame: the compression flag, the length,
/// then the `ListAndWatchResponse` itself.
fn encode_frame(inventory: &Inventory, sharing: Sharing) -> Bytes {
    let len = encoded_len(advertised(inventory, sharing));
    let mut frame = BytesMut::with_capacity(GRPC_HEADER + len);
    frame.put_u8(0);
    // The kubelet's limit is far below 4 GiB, which start-up checks.
    frame.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    for device in advertised(inventory, sharing) {
        prost::encoding::message::encode(1, &device, &mut frame);
    }
    frame.freeze()
}

/// A gRPC message's prefix: a compression flag and a 4-byte length.
const GRPC_HEADER: usize = 5;

/// The kubelet reads ListAndWatch with gRPC's default receive limit and drops a stream whose
/// message is larger, every time it is sent.
pub(crate) const KUBELET_MESSAGE_LIMIT: usize = 4 << 20;

/// The memory limit the shipped manifests give the pod; a test holds them to it.
pub(crate) const POD_MEMORY_LIMIT: usize = 64 << 20;

/// The share of [`POD_MEMORY_LIMIT`] the device list may take at its peak: the rest is for the
/// plugin itself, scrapes, Allocate and GetPreferredAllocation requests, and allocator slack.
const LIST_MEMORY_BUDGET: usize = POD_MEMORY_LIMIT / 4 * 3;

/// What the plugin holds besides its device list, measured (VmHWM) with no sharing.
const BASE_MEMORY: usize = BASE_MEMORY_MIB << 20;
const BASE_MEMORY_MIB: usize = 8;

/// Copies of the encoded list alive at a change at most: the current frame, the one being
/// encoded, and one a slow stream still holds.
const LIST_COPIES: usize = 3;

/// What the CDI spec writer holds per advertised ID at its peak, when a change renders the spec
/// again while the last one is kept: two texts of about 300 bytes per device, their growth
/// slack, and the rendered devices (`benches/memory.rs`: 810 EFAs × 64 in cdi mode peaked at
/// 52.5 MiB, 785 bytes per ID over the device-specs figure, on a quiet host; 613 EFAs × 64
/// peaked at 51.2 MiB on a busy one, where a slow reader keeps more lists and specs alive:
/// 1,043 bytes per ID over the base and the lists).
const CDI_BYTES_PER_ID: usize = 1050;

/// What the PodResources view holds per advertised ID at its peak with every ID held: the
/// kubelet's answer, received and decoded (a string per ID), and the view derived from it next
/// to the one it replaces (an entry per EFA and container, the container's names shared by all
/// its IDs). `benches/memory.rs`: 600 EFAs × 64 in cdi mode, every replica held by 64 pods with
/// the longest names, through a flap and a GetPreferredAllocation, peaked 1.1 MiB over the
/// same without holders (3.9 MiB in the worst of three runs: 30 to 106 bytes per ID).
const HELD_BYTES_PER_ID: usize = 160;

/// What the record of IDs Allocate gave out lately (`allocation::recent`) holds at its peak,
/// with every ID given out within its window: a time per ID, 16 bytes, as many as the highest
/// replica given out of each EFA (sized exactly)...
const RECENT_BYTES_PER_ID: usize = 16;

/// ...and per EFA, an entry naming it once: measured (glibc's `mallinfo2`, 1,780 EFAs given
/// out in random order) at 195 bytes with a 63-character name unshared, 249 with 2 replicas
/// (the replicas' times included); plus the set of EFA IDs the health monitor reads from it,
/// 105 bytes each with that name.
const RECENT_BYTES_PER_EFA: usize = 340;

/// Refuses a sharing count under which the device list of `inventory` could exceed
/// [`KUBELET_MESSAGE_LIMIT`], or the memory it takes at its peak (in cdi mode, with the spec
/// writer's; with every ID held, the PodResources view's; with every ID given out lately, the
/// record of them) the pod's limit. Sized for the worst
/// case, every ID `Unhealthy` (the longest health), so no health change can push a list that
/// passed over either. The reason starts with the count, for the caller to name the setting.
pub(crate) fn check_sharing_fits(
    inventory: &Inventory,
    sharing: Sharing,
    cdi: bool,
) -> Result<(), String> {
    let size = |sharing: Sharing| {
        encoded_len(advertised(inventory, sharing).map(|mut device| {
            device.health = UNHEALTHY.into();
            device
        }))
    };
    let memory = |sharing: Sharing| {
        let efas = inventory.devices().len();
        let ids = efas * sharing.replicas.get() as usize;
        let spec = if cdi { ids * CDI_BYTES_PER_ID } else { 0 };
        let recent = efas * RECENT_BYTES_PER_EFA + ids * RECENT_BYTES_PER_ID;
        BASE_MEMORY + LIST_COPIES * size(sharing) + spec + ids * HELD_BYTES_PER_ID + recent
    };
    let fits = |sharing: Sharing| {
        size(sharing) <= KUBELET_MESSAGE_LIMIT && memory(sharing) <= LIST_MEMORY_BUDGET
    };
    if fits(sharing) {
        return Ok(());
    }
    let replicas = sharing.replicas.get();
    // Both grow with the count, so the largest that fits is found by bisection.
    let fitting = (1..replicas)
        .collect::<Vec<_>>()
        .partition_point(|&r| NonZeroU32::new(r).is_some_and(|r| fits(Sharing::replicas(r))));
    let efas = inventory.devices().len();
    let worst = size(sharing);
    let why = if worst > KUBELET_MESSAGE_LIMIT {
        format!(
            "{efas} EFAs make a device list of up to {worst} bytes, over the kubelet's {KUBELET_MESSAGE_LIMIT}-byte message limit"
        )
    } else {
        format!(
            "{efas} EFAs{} need about {} MiB at a change, over the {} MiB of the pod's {} MiB memory limit the device list may take",
            if cdi { " in cdi mode" } else { "" },
            memory(sharing) >> 20,
            LIST_MEMORY_BUDGET >> 20,
            POD_MEMORY_LIMIT >> 20,
        )
    };
    Err(format!("{replicas}: {why}; at most {fitting} fit"))
}

fn to_device(id: String, record: &DeviceRecord) -> Device {
    Device {
        id,
        health: record.verdict.health.to_string(),
        // A device without NUMA affinity carries no topology: an empty node list would still be
        // read as "no preference", but an absent one says so plainly.
        topology: record.efa.numa_node.map(|node| TopologyInfo {
            nodes: vec![NumaNode { id: node.into() }],
        }),
    }
}

/// Offers up to this many IDs are answered on the runtime thread: they take well under a
/// millisecond, less than handing them to another thread would cost in latency.
const INLINE_OFFER: usize = 512;

/// Larger offers are answered one at a time, each on a blocking thread: one costs up to about
/// 18 MiB at 256 EFAs × 64 replicas, and sixteen at once took the plugin past the pod's limit.
/// The kubelet never has two in flight: it admits pods one at a time, and calls
/// GetPreferredAllocation from inside an admission (`devicesToAllocate`, device manager), so a
/// second caller at once is some other client, which waits its turn. Process-wide rather than
/// per registration, so a request still running from before a kubelet restart counts too.
static PREFERRING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

type ListStream = tokio_stream::Empty<Result<ListAndWatchResponse, Status>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        self.hooks
            .options_asked(request.extensions().get::<ConnectionId>().copied());
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = ListStream;

    /// Never reached: [`PluginServer`] answers ListAndWatch itself, with the shared frames
    /// this trait's per-stream messages could not carry.
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        Err(Status::internal(
            "ListAndWatch is served by the plugin's own route",
        ))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let inventory = self.devices.borrow().clone();
        let request = request.into_inner();
        let offered: usize = request
            .container_requests
            .iter()
            .map(|c| c.available_device_i_ds.len())
            .sum();
        if offered <= INLINE_OFFER {
            return Ok(Response::new(
                self.allocator.preferred(&inventory, &request),
            ));
        }
        // The runtime has one thread: a large answer computed on it would hold up every other
        // RPC and the probes for as long as it takes. The turn goes with the computation, so a
        // caller that gives up frees it only when the computation ends.
        let turn = PREFERRING
            .acquire()
            .await
            .map_err(|err| Status::internal(format!("GetPreferredAllocation failed: {err}")))?;
        let allocator = self.allocator.clone();
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            allocator.preferred(&inventory, &request)
        })
        .await
        .map(Response::new)
        .map_err(|err| Status::internal(format!("GetPreferredAllocation failed: {err}")))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let inventory = self.devices.borrow().clone();
        match self.allocator.allocate(&inventory, request.get_ref()) {
            Ok(response) => Ok(Response::new(response)),
            Err(err) => {
                tracing::warn!(error = %err, "refused an Allocate request");
                Err(match err {
                    AllocateError::Unknown(_) => Status::invalid_argument(err.to_string()),
                    AllocateError::Unhealthy { .. } => Status::failed_precondition(err.to_string()),
                })
            }
        }
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// ListAndWatch streams served at once, not counting the kubelet's, which is always accepted.
/// The kubelet opens one per registration; the rest leaves room for a debugging tool or two,
/// while a client opening streams in a loop gets [`Status::resource_exhausted`] instead of
/// the plugin's memory.
pub(crate) const MAX_STREAMS: usize = 8;

const LIST_AND_WATCH: &str = "/v1beta1.DevicePlugin/ListAndWatch";

/// The device list of the latest snapshot, encoded once for every stream of the generation.
struct Lists {
    sharing: Sharing,
    latest: Mutex<Option<(Arc<Inventory>, Bytes)>>,
}

impl Lists {
    /// The frame for `inventory`. A snapshot whose list did not change keeps the frame it had,
    /// so a stream can tell by identity alone that it has nothing new to send.
    fn frame(&self, inventory: &Arc<Inventory>) -> Bytes {
        let mut latest = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seen, frame)) = latest.as_ref()
            && Arc::ptr_eq(seen, inventory)
        {
            return frame.clone();
        }
        let mut frame = encode_frame(inventory, self.sharing);
        if let Some((_, unchanged)) = latest.take().filter(|(_, old)| *old == frame) {
            frame = unchanged;
        }
        *latest = Some((inventory.clone(), frame.clone()));
        frame
    }
}

/// The generation's gRPC service: ListAndWatch answered here, from frames shared by every
/// stream (each holds a reference, not a copy, however many are open or slow to read), the
/// other methods by the generated server.
#[derive(Clone)]
pub(crate) struct PluginServer {
    service: Arc<PluginService>,
    lists: Arc<Lists>,
    grpc: DevicePluginServer<PluginService>,
}

pub(crate) fn server(service: PluginService) -> PluginServer {
    let service = Arc::new(service);
    PluginServer {
        lists: Arc::new(Lists {
            sharing: service.allocator.sharing(),
            latest: Mutex::default(),
        }),
        grpc: DevicePluginServer::from_arc(service.clone()),
        service,
    }
}

impl NamedService for PluginServer {
    const NAME: &'static str = SERVICE_NAME;
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send + 'static>>;

impl tower::Service<http::Request<Body>> for PluginServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> ResponseFuture {
        if request.uri().path() != LIST_AND_WATCH {
            return self.grpc.call(request);
        }
        let opened = self.open_stream(request.extensions().get::<ConnectionId>().copied());
        Box::pin(async move {
            // The request is an `Empty`; read it to its end, as a unary server would, before
            // answering.
            let _ = http_body_util::BodyExt::collect(http_body_util::Limited::new(
                request.into_body(),
                1024,
            ))
            .await;
            Ok(match opened {
                Ok(list) => {
                    let mut response = http::Response::new(Body::new(list));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc"),
                    );
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

impl PluginServer {
    fn open_stream(&self, connection: Option<ConnectionId>) -> Result<ListBody, Status> {
        let service = &self.service;
        let hooks = &service.hooks;
        let others = hooks
            .open
            .borrow()
            .saturating_sub(usize::from(*hooks.kubelet_stream.borrow()));
        let guard = StreamGuard::new(hooks.clone(), service.stop.clone(), connection);
        if !guard.kubelets && others >= MAX_STREAMS {
            return Err(Status::resource_exhausted(format!(
                "at most {MAX_STREAMS} ListAndWatch streams are served at once; close one first"
            )));
        }
        Ok(ListBody {
            devices: WatchStream::new(service.devices.subscribe()),
            lists: self.lists.clone(),
            sent: None,
            stopped: Box::pin(service.stop.clone().cancelled_owned()),
            ended: false,
            _guard: guard,
        })
    }
}

/// One ListAndWatch stream: the full list at once and after every change, until the generation
/// stops (then `OK`) or the client goes (then hyper drops it, and the guard counts it closed).
struct ListBody {
    devices: WatchStream<Arc<Inventory>>,
    lists: Arc<Lists>,
    /// The frame last sent, compared by identity.
    sent: Option<Bytes>,
    stopped: Pin<Box<WaitForCancellationFutureOwned>>,
    ended: bool,
    _guard: StreamGuard,
}

impl hyper::body::Body for ListBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        loop {
            let inventory = match this.stopped.as_mut().poll(cx) {
                Poll::Ready(()) => None,
                Poll::Pending => match Pin::new(&mut this.devices).poll_next(cx) {
                    Poll::Ready(next) => next,
                    Poll::Pending => return Poll::Pending,
                },
            };
            let Some(inventory) = inventory else {
                this.ended = true;
                let mut trailers = http::HeaderMap::new();
                trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            };
            let frame = this.lists.frame(&inventory);
            if this.sent.as_ref().is_some_and(|sent| same(sent, &frame)) {
                continue;
            }
            this.sent = Some(frame.clone());
            return Poll::Ready(Some(Ok(Frame::data(frame))));
        }
    }
}

/// Whether two frames are one and the same, not merely equal.
fn same(a: &Bytes, b: &Bytes) -> bool {
    a.as_ptr() == b.as_ptr() && a.len() == b.len()
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::testkit::simulate::{Shape, inventory};

    fn shared(n: u32) -> Sharing {
        Sharing::replicas(NonZeroU32::new(n).unwrap())
    }

    #[test]
    fn a_cdi_spec_too_large_for_the_pods_memory_is_refused_with_the_largest_count_that_fits() {
        // The most EFAs whose list at 64 replicas fits the kubelet's message limit.
        let dense = inventory(Shape::Dense(1780));
        let fits = |replicas, cdi| check_sharing_fits(&dense, shared(replicas), cdi);
        assert_eq!(fits(64, false), Ok(()));
        let refused = fits(64, true).unwrap_err();
        assert!(refused.starts_with("64:"), "{refused}");
        assert!(
            refused.contains("cdi mode") && refused.contains("64 MiB"),
            "{refused}"
        );
        let fitting: u32 = refused
            .rsplit("at most ")
            .next()
            .unwrap()
            .trim_end_matches(" fit")
            .parse()
            .unwrap();
        assert!((1..64).contains(&fitting), "{refused}");
        assert_eq!(fits(fitting, true), Ok(()));
        assert!(fits(fitting + 1, true).is_err());
    }

    /// Blocking-pool threads of this process named `name`.
    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == name)
            .count()
    }

    #[test]
    fn large_preferred_allocations_are_computed_one_at_a_time() {
        const POOL: &str = "gpa-turns-test";
        let runtime = tokio::runtime::Builder::new_current_thread()
            .thread_name(POOL)
            .build()
            .unwrap();
        let sharing = shared(4);
        let dense = Arc::new(inventory(Shape::Dense256));
        let offered: Vec<String> = advertised(&dense, sharing).map(|d| d.id).collect();
        assert!(offered.len() > INLINE_OFFER);
        let dir = tempfile::tempdir().unwrap();
        let contributors = crate::allocation::contributors(
            dir.path(),
            &Default::default(),
            crate::allocation::FoundNodes::none(),
        );
        let service = Arc::new(PluginService {
            devices: crate::state::Writer::new(dense).reader(),
            allocator: Arc::new(
                Allocator::new(Box::new(crate::allocation::DeviceSpecs), contributors)
                    .with_sharing(sharing),
            ),
            hooks: Arc::default(),
            stop: CancellationToken::new(),
        });
        let request = PreferredAllocationRequest {
            container_requests: vec![
                crate::proto::deviceplugin::ContainerPreferredAllocationRequest {
                    available_device_i_ds: offered,
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: 64,
                },
            ],
        };
        // Sixteen callers at once, as a client other than the kubelet may make them.
        let answers = runtime.block_on(async {
            let mut calls = tokio::task::JoinSet::new();
            for _ in 0..16 {
                let (service, request) = (service.clone(), Request::new(request.clone()));
                calls.spawn(async move { service.get_preferred_allocation(request).await });
            }
            calls.join_all().await
        });
        for answer in answers {
            assert_eq!(
                answer.unwrap().into_inner().container_responses[0]
                    .device_i_ds
                    .len(),
                64
            );
        }
        // Each computation at once took a thread of its own; in turns, one thread serves them
        // all (two, when a turn's next caller comes before its thread is idle again).
        let threads = threads_named(POOL);
        assert!((1..=2).contains(&threads), "{threads} blocking threads");
    }

    #[test]
    fn the_budget_counts_the_pod_view_with_every_id_held() {
        // Fits with the spec writer's share alone; with every ID held, 540 EFAs at 64 replicas
        // would take about 6 MiB more than the pod's share has left.
        let refused =
            check_sharing_fits(&inventory(Shape::Dense(540)), shared(64), true).unwrap_err();
        assert!(refused.contains("in cdi mode need about"), "{refused}");
    }

    #[test]
    fn the_budget_counts_the_record_of_ids_given_out_lately() {
        // 494 EFAs at 64 replicas in cdi mode fit by 0.3 MiB without the record; with every ID
        // given out within its window it takes 0.6 MiB more.
        let refused =
            check_sharing_fits(&inventory(Shape::Dense(494)), shared(64), true).unwrap_err();
        assert!(refused.contains("in cdi mode need about"), "{refused}");
    }

    /// The budget is a share of the limit the shipped manifests set: both must name one figure.
    #[test]
    fn the_pod_memory_limit_is_the_one_the_manifests_set() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests");
        let read = |file: &str| -> serde_yaml::Value {
            serde_yaml::from_str(&std::fs::read_to_string(root.join(file)).unwrap()).unwrap()
        };
        let daemonset = read("base/daemonset.yaml");
        let values = read("helm/efa-device-plugin/values.yaml");
        let limits = [
            &daemonset["spec"]["template"]["spec"]["containers"][0]["resources"],
            &values["resources"],
        ]
        .map(|resources| resources["limits"]["memory"].as_str().map(str::to_owned));
        let ours = format!("{}Mi", POD_MEMORY_LIMIT >> 20);
        assert_eq!(limits, [Some(ours.clone()), Some(ours)]);
    }

    #[test]
    fn the_kubelets_stream_is_the_first_on_a_connection_it_dialled_back_during_register() {
        let (kubelet, tool, late) = (ConnectionId(1), ConnectionId(2), ConnectionId(3));
        let hooks = StreamHooks::default();
        hooks.options_asked(Some(late));
        hooks.registering();
        // A tool's stream first, at the very instant Register is sent.
        assert!(!hooks.claim_kubelet_stream(Some(tool)));
        hooks.options_asked(Some(kubelet));
        hooks.registered();
        hooks.options_asked(Some(late));
        assert!(
            !hooks.claim_kubelet_stream(Some(late)),
            "asked after Register"
        );
        assert!(!hooks.claim_kubelet_stream(None));
        assert!(!*hooks.kubelet_stream().borrow());
        assert!(hooks.claim_kubelet_stream(Some(kubelet)));
        assert!(*hooks.kubelet_stream().borrow());
        assert!(
            !hooks.claim_kubelet_stream(Some(kubelet)),
            "one stream only"
        );
    }

    #[test]
    fn every_stream_gets_the_same_frame_until_the_list_changes() {
        let lists = Lists {
            sharing: shared(4),
            latest: Mutex::default(),
        };
        let first = Arc::new(inventory(Shape::P5));
        let frame = lists.frame(&first);
        assert!(same(&frame, &lists.frame(&first)));
        // A new snapshot with the same list keeps the frame; a changed one gets its own.
        assert!(same(&frame, &lists.frame(&Arc::new(inventory(Shape::P5)))));
        let changed = lists.frame(&Arc::new(inventory(Shape::P4d)));
        assert!(!same(&frame, &changed));
        let decoded = ListAndWatchResponse::decode(&changed[GRPC_HEADER..]).unwrap();
        assert_eq!(decoded.devices.len(), 4 * 4);
        assert_eq!(
            changed.len() - GRPC_HEADER,
            u32::from_be_bytes(changed[1..5].try_into().unwrap()) as usize
        );
    }
}
