//! The `DevicePlugin` gRPC service: translation between the wire and the plugin's state.
//!
//! Device state is read from [`crate::state`], allocation decided by [`crate::allocation`];
//! nothing here owns data. One service instance lives for one registration generation.

use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prost::Message;
use tokio::sync::{Notify, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::allocation::sharing::Sharing;
use crate::allocation::{AllocateError, Allocator};
use crate::config::ConfigError;
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo, UNHEALTHY, device_plugin_server::DevicePlugin,
};
use crate::state::{DeviceRecord, Inventory};

/// What the lifecycle learns from the streams of one generation.
#[derive(Default)]
pub(crate) struct StreamHooks {
    open: watch::Sender<usize>,
    /// Set when Register is sent: the kubelet opens its stream only after receiving it.
    registering: AtomicBool,
    /// Whether a stream already counts as the kubelet's.
    kubelet_stream_opened: AtomicBool,
    /// Signalled when the kubelet ends its stream (rather than the plugin stopping it).
    ended_by_kubelet: Notify,
}

impl StreamHooks {
    pub(crate) fn open_streams(&self) -> watch::Receiver<usize> {
        self.open.subscribe()
    }

    /// Called just before Register: the first stream opened from now on is the kubelet's.
    /// Streams of other clients (a debugging tool, a second reader) come and go without
    /// ending the registration.
    pub(crate) fn registering(&self) {
        self.registering.store(true, Ordering::Release);
    }

    pub(crate) async fn ended_by_kubelet(&self) {
        self.ended_by_kubelet.notified().await
    }

    fn claim_kubelet_stream(&self) -> bool {
        self.registering.load(Ordering::Acquire)
            && !self.kubelet_stream_opened.swap(true, Ordering::AcqRel)
    }
}

/// Counts a stream as open while alive, and reports how the kubelet's stream ended.
struct StreamGuard {
    hooks: Arc<StreamHooks>,
    stop: CancellationToken,
    kubelets: bool,
}

impl StreamGuard {
    fn new(hooks: Arc<StreamHooks>, stop: CancellationToken) -> Self {
        hooks.open.send_modify(|n| *n += 1);
        let kubelets = hooks.claim_kubelet_stream();
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

pub(crate) struct PluginService {
    pub devices: watch::Receiver<Arc<Inventory>>,
    pub allocator: Arc<Allocator>,
    pub hooks: Arc<StreamHooks>,
    /// Cancelled when this generation stops: streams end, so the server can shut down.
    pub stop: CancellationToken,
}

/// The device list as the kubelet sees it: every advertised ID of an EFA carries its health
/// and NUMA node.
pub(crate) fn list_response(inventory: &Inventory, sharing: Sharing) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: inventory
            .devices()
            .flat_map(|record| {
                sharing
                    .advertised(&record.efa.id)
                    .map(move |id| to_device(id, record))
            })
            .collect(),
    }
}

/// The kubelet reads ListAndWatch with gRPC's default receive limit and drops a stream whose
/// message is larger, every time it is sent.
pub(crate) const KUBELET_MESSAGE_LIMIT: usize = 4 << 20;

/// Refuses a sharing count under which the device list of `inventory` could exceed
/// [`KUBELET_MESSAGE_LIMIT`]. Sized for the worst case, every ID `Unhealthy` (the longest
/// health), so no health change can push a list that passed over the limit.
pub(crate) fn check_list_fits(inventory: &Inventory, sharing: Sharing) -> Result<(), ConfigError> {
    let size = |sharing: Sharing| {
        let mut list = list_response(inventory, sharing);
        for device in &mut list.devices {
            device.health = UNHEALTHY.into();
        }
        list.encoded_len()
    };
    let worst = size(sharing);
    if worst <= KUBELET_MESSAGE_LIMIT {
        return Ok(());
    }
    let replicas = sharing.replicas.get();
    let fitting = (1..replicas)
        .rev()
        .filter_map(NonZeroU32::new)
        .find(|&r| size(Sharing::replicas(r)) <= KUBELET_MESSAGE_LIMIT)
        .map_or(0, NonZeroU32::get);
    Err(ConfigError(format!(
        "--sharing-replicas (sharing.replicas) {replicas}: {} EFAs make a device list of up to {worst} bytes, over the kubelet's {KUBELET_MESSAGE_LIMIT}-byte message limit; at most {fitting} fit",
        inventory.devices().len(),
    )))
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

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut devices = self.devices.clone();
        let sharing = self.allocator.sharing();
        let stop = self.stop.clone();
        let guard = StreamGuard::new(self.hooks.clone(), stop.clone());
        tokio::spawn(async move {
            let _guard = guard;
            let mut last_sent = None;
            loop {
                let snapshot = list_response(&devices.borrow_and_update(), sharing);
                if last_sent.as_ref() != Some(&snapshot) {
                    if tx.send(Ok(snapshot.clone())).await.is_err() {
                        return;
                    }
                    last_sent = Some(snapshot);
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    changed = devices.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
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
        // RPC and the probes for as long as it takes.
        let allocator = self.allocator.clone();
        tokio::task::spawn_blocking(move || allocator.preferred(&inventory, &request))
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
