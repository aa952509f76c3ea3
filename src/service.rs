//! The `DevicePlugin` gRPC service: translation between the wire and the plugin's state.
//!
//! Device state is read from [`crate::state`], allocation decided by [`crate::allocation`];
//! nothing here owns data. One service instance lives for one registration generation.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{Notify, mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::allocation::sharing::Sharing;
use crate::allocation::{AllocateError, Allocator};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, Device, DevicePluginOptions, Empty, ListAndWatchResponse,
    NumaNode, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse, TopologyInfo, device_plugin_server::DevicePlugin,
};
use crate::state::{DeviceRecord, Inventory};

/// What the lifecycle learns from the streams of one generation.
#[derive(Default)]
pub struct StreamHooks {
    open: watch::Sender<usize>,
    /// Signalled when the kubelet ends a stream (rather than the plugin stopping it).
    ended_by_kubelet: Notify,
}

impl StreamHooks {
    pub fn open_streams(&self) -> watch::Receiver<usize> {
        self.open.subscribe()
    }

    pub async fn ended_by_kubelet(&self) {
        self.ended_by_kubelet.notified().await
    }
}

/// Counts a stream as open while alive, and reports how it ended.
struct StreamGuard {
    hooks: Arc<StreamHooks>,
    stop: CancellationToken,
}

impl StreamGuard {
    fn new(hooks: Arc<StreamHooks>, stop: CancellationToken) -> Self {
        hooks.open.send_modify(|n| *n += 1);
        StreamGuard { hooks, stop }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.hooks.open.send_modify(|n| *n -= 1);
        if !self.stop.is_cancelled() {
            self.hooks.ended_by_kubelet.notify_one();
        }
    }
}

pub struct PluginService {
    pub devices: watch::Receiver<Arc<Inventory>>,
    pub allocator: Arc<Allocator>,
    pub hooks: Arc<StreamHooks>,
    /// Cancelled when this generation stops: streams end, so the server can shut down.
    pub stop: CancellationToken,
}

/// The device list as the kubelet sees it: every advertised ID of an EFA carries its health
/// and NUMA node.
pub fn list_response(inventory: &Inventory, sharing: Sharing) -> ListAndWatchResponse {
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
        Ok(Response::new(
            self.allocator.preferred(&inventory, request.get_ref()),
        ))
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
