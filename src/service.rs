//! The `DevicePlugin` gRPC service: translation between the wire and the plugin's state.
//!
//! Device state is read from [`crate::state`], allocation decided by [`crate::allocation`];
//! nothing here owns data. One service instance lives for one registration generation.

use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::allocation::sharing::Sharing;
use crate::allocation::{AllocateError, Allocator};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo, device_plugin_server::DevicePlugin,
};
use crate::state::{DeviceReader, DeviceRecord, Inventory};
use crate::uds::ConnectionId;

pub(crate) mod budget;
pub(crate) mod server;

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

/// The service of one generation; [`server::PluginServer`] is the gRPC server that answers for
/// it.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::sharing::shared;
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
}
