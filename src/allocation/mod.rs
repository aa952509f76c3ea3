//! Turns allocated device IDs into what the container runtime needs.
//!
//! Answers come from the in-memory snapshot only: the kubelet waits on Allocate with no deadline,
//! so this path does no sysfs I/O. Each part of the response comes from a [`Contributor`]: the
//! device-specs strategy composes [`DeviceNodes`] and [`Environment`], the cdi strategy
//! [`crate::cdi::CdiDevices`] alone. Which IDs to prefer is [`preferred`]'s business; what an ID
//! means when EFAs are shared, [`sharing`]'s.

pub mod metrics;
pub mod preferred;
pub mod sharing;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::discovery::Efa;
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, DeviceSpec,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::state::{Holdings, Inventory};
use metrics::AllocationMetrics;
use sharing::Sharing;
use tokio::sync::watch;

/// Where the container finds a device node. It must equal the host's own path, because
/// libibverbs pairs `/sys/class/infiniband_verbs/uverbsN` with `/dev/infiniband/uverbsN`.
pub(crate) const CONTAINER_NODE_DIR: &str = "/dev/infiniband";

/// Why an Allocate request cannot be served; the kubelet shows this text in the pod's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("unknown device ID {0:?}: not an EFA on this node")]
    Unknown(String),
    #[error("device {id:?} is unhealthy: {reason}")]
    Unhealthy { id: String, reason: String },
}

/// One EFA of a container's allocation, with the first ID the kubelet asked for it by.
#[derive(Clone, Copy, Debug)]
pub struct Allocated<'a> {
    pub id: &'a str,
    pub efa: &'a Efa,
}

/// Adds one aspect of the devices to a container's allocation.
pub trait Contributor: Send + Sync {
    fn contribute(&self, devices: &[Allocated], response: &mut ContainerAllocateResponse);
}

/// One `rw` DeviceSpec per allocated uverbs node, and nothing else of `/dev/infiniband`: exposing
/// foreign RDMA nodes makes libfabric's EFA provider fail.
pub struct DeviceNodes {
    pub dev_root: PathBuf,
}

impl Contributor for DeviceNodes {
    fn contribute(&self, devices: &[Allocated], response: &mut ContainerAllocateResponse) {
        for Allocated { efa, .. } in devices {
            response.devices.push(DeviceSpec {
                container_path: format!("{CONTAINER_NODE_DIR}/{}", efa.uverbs),
                host_path: efa.node_path(&self.dev_root).display().to_string(),
                permissions: "rw".into(),
            });
        }
    }
}

/// The same environment in every container: with device-specs, the kubelet passes these to the
/// runtime as they are.
pub(crate) struct Environment {
    pub env: BTreeMap<String, String>,
}

impl Contributor for Environment {
    fn contribute(&self, _: &[Allocated], response: &mut ContainerAllocateResponse) {
        response
            .envs
            .extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

/// Serves Allocate from the current snapshot.
pub struct Allocator {
    contributors: Vec<Box<dyn Contributor>>,
    sharing: Sharing,
    metrics: Option<Arc<AllocationMetrics>>,
    holdings: Option<watch::Receiver<Arc<Holdings>>>,
}

impl Allocator {
    pub fn new(contributors: Vec<Box<dyn Contributor>>) -> Self {
        Allocator {
            contributors,
            sharing: Sharing::default(),
            metrics: None,
            holdings: None,
        }
    }

    /// Steers preferred allocations away from EFAs that pods hold under foreign IDs, as the
    /// background PodResources view last saw them.
    pub fn with_holdings(mut self, holdings: watch::Receiver<Arc<Holdings>>) -> Self {
        self.holdings = Some(holdings);
        self
    }

    /// Serves the IDs `sharing` advertises instead of one per EFA.
    pub fn with_sharing(self, sharing: Sharing) -> Self {
        Allocator { sharing, ..self }
    }

    /// Counts and times every answer in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<AllocationMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn sharing(&self) -> Sharing {
        self.sharing
    }

    pub fn preferred(
        &self,
        inventory: &Inventory,
        request: &PreferredAllocationRequest,
    ) -> PreferredAllocationResponse {
        let holdings = self.holdings.as_ref().map(|h| h.borrow().clone());
        let foreign_held = holdings.as_ref().map(|h| &h.foreign_devices);
        let response = preferred::respond(
            inventory,
            self.sharing,
            foreign_held.unwrap_or(&BTreeSet::new()),
            request,
        );
        // What the kubelet offered under its NUMA affinity, next to what came back: the only
        // place an operator (or a test) can see the kubelet's filtering.
        for (offer, answer) in request
            .container_requests
            .iter()
            .zip(&response.container_responses)
        {
            tracing::debug!(
                offered = %offer.available_device_i_ds.join(","),
                must_include = %offer.must_include_device_i_ds.join(","),
                size = offer.allocation_size,
                answer = %answer.device_i_ds.join(","),
                "answered GetPreferredAllocation"
            );
        }
        response
    }

    pub fn allocate(
        &self,
        inventory: &Inventory,
        request: &AllocateRequest,
    ) -> Result<AllocateResponse, AllocateError> {
        let started = Instant::now();
        let answer = self.answer(inventory, request);
        if let Some(metrics) = &self.metrics {
            metrics.record(answer.is_ok(), started.elapsed());
        }
        answer
    }

    fn answer(
        &self,
        inventory: &Inventory,
        request: &AllocateRequest,
    ) -> Result<AllocateResponse, AllocateError> {
        let mut container_responses = Vec::with_capacity(request.container_requests.len());
        for container in &request.container_requests {
            let devices = resolve(inventory, self.sharing, &container.devices_ids)?;
            let mut response = ContainerAllocateResponse::default();
            for contributor in &self.contributors {
                contributor.contribute(&devices, &mut response);
            }
            container_responses.push(response);
        }
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

/// Maps requested IDs to healthy devices, each device once even if asked for twice or through
/// several of its replicas: a container gets one node per EFA, however many IDs it holds.
fn resolve<'a>(
    inventory: &'a Inventory,
    sharing: Sharing,
    ids: &'a [String],
) -> Result<Vec<Allocated<'a>>, AllocateError> {
    let mut seen = BTreeSet::new();
    let mut devices = Vec::with_capacity(ids.len());
    for id in ids {
        let record = sharing
            .parse(id)
            .and_then(|(device, _)| inventory.get(device))
            .ok_or_else(|| AllocateError::Unknown(id.clone()))?;
        if !record.is_healthy() {
            return Err(AllocateError::Unhealthy {
                id: id.clone(),
                reason: record.verdict.reason.clone().unwrap_or_default(),
            });
        }
        if seen.insert(record.efa.id.as_str()) {
            devices.push(Allocated {
                id,
                efa: &record.efa,
            });
        }
    }
    Ok(devices)
}
