//! The `DevicePlugin` gRPC service: translation between the wire and the plugin's state.
//!
//! Device state is read from [`crate::state`], allocation decided by [`crate::allocation`];
//! nothing here owns data. One service instance lives for one registration generation.

use std::convert::Infallible;
use std::future::Future;
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
    PreferredAllocationResponse, TopologyInfo,
    device_plugin_server::{DevicePlugin, DevicePluginServer, SERVICE_NAME},
};
use crate::state::{DeviceReader, DeviceRecord, Inventory};
use crate::uds::ConnectionId;

pub(crate) mod budget;

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
    use crate::allocation::sharing::shared;
    use prost::Message;

    use super::*;
    use crate::testkit::simulate::{Shape, inventory};

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
