//! Turns allocated device IDs into what the container runtime needs.
//!
//! Answers come from the in-memory snapshot only: the kubelet waits on Allocate with no deadline,
//! so this path does no sysfs I/O. What a container gets is said once, as [`Edits`], by the
//! [`Contributor`]s that [`contributors`] lists: a node per allocated EFA, and `allocate.env`.
//! A [`Delivery`] hands those edits to the runtime by the device-list strategy: [`DeviceSpecs`]
//! puts them in the Allocate answer, [`crate::cdi`] into the CDI spec file, with an answer that
//! names the devices. A contributor knows nothing of the strategies, so it cannot reach one and
//! miss the other. Which IDs to prefer is [`preferred`]'s business, steered by the IDs given out
//! lately ([`recent`]); what an ID means when EFAs are shared, [`sharing`]'s.

pub mod metrics;
pub mod preferred;
pub mod recent;
pub mod sharing;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::discovery::{DevNum, Efa};
use crate::proto::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, DeviceSpec,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::state::{Holdings, Inventory, Reader, Writer};
use metrics::AllocationMetrics;
use preferred::Avoid;
use recent::Recent;
use sharing::Sharing;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt};

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

/// What a container gets, in terms that both strategies can deliver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    pub device_nodes: Vec<DeviceNode>,
    pub env: BTreeMap<String, String>,
}

impl Edits {
    /// The edits as the Allocate answer carries them, for the runtime to apply as they are.
    ///
    /// Destructured with no `..`, here and in `cdi`, so that a new kind of edit does not compile
    /// until both strategies deliver it.
    fn answer(self, response: &mut ContainerAllocateResponse) {
        let Edits { device_nodes, env } = self;
        response.devices.extend(device_nodes.into_iter().map(
            |DeviceNode {
                 container_path,
                 host_path,
                 // The runtime finds the node at its host path and reads the number itself.
                 dev: _,
                 permissions,
             }| DeviceSpec {
                container_path,
                host_path: host_path.display().to_string(),
                permissions: permissions.into(),
            },
        ));
        response.envs.extend(env);
    }
}

/// A device node in the container. The CDI spec names it by `dev`, read from sysfs; an
/// Allocate answer by `host_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    pub container_path: String,
    pub host_path: PathBuf,
    pub dev: DevNum,
    pub permissions: &'static str,
}

/// Adds one aspect of the devices to what a container gets. Both methods are required, so a
/// new contributor says what it adds per EFA and per container, and both strategies carry it.
pub trait Contributor: Send + Sync {
    /// What the container gets for each allocated EFA; the CDI spec puts it in that EFA's entry.
    fn device_edits(&self, efa: &Efa, edits: &mut Edits);
    /// What the container gets once, whichever EFAs it holds; the CDI spec puts it in its own
    /// container edits, which the runtime applies once for any of the spec's devices.
    fn container_edits(&self, edits: &mut Edits);
}

/// The contributors the Allocator and the CDI spec writer share.
#[derive(Clone)]
pub struct Contributors(Arc<[Box<dyn Contributor>]>);

impl Contributors {
    pub fn new(contributors: Vec<Box<dyn Contributor>>) -> Self {
        Contributors(contributors.into())
    }

    pub fn device_edits(&self, efa: &Efa) -> Edits {
        let mut edits = Edits::default();
        for contributor in self.0.iter() {
            contributor.device_edits(efa, &mut edits);
        }
        edits
    }

    pub fn container_edits(&self) -> Edits {
        let mut edits = Edits::default();
        for contributor in self.0.iter() {
            contributor.container_edits(&mut edits);
        }
        edits
    }
}

/// What every container gets, whichever the strategy: its EFAs' nodes, `env`, and the extra
/// host nodes `extra` holds. The one list to extend with a new contributor; `cdi`'s tests show
/// one reaching both strategies.
pub fn contributors(
    dev_root: &Path,
    env: &BTreeMap<String, String>,
    extra: FoundNodes,
) -> Contributors {
    Contributors::new(vec![
        Box::new(DeviceNodes {
            dev_root: dev_root.to_owned(),
        }),
        Box::new(Environment { env: env.clone() }),
        Box::new(extra),
    ])
}

/// One `rw` node per allocated uverbs device, and nothing else of `/dev/infiniband`: exposing
/// foreign RDMA nodes makes libfabric's EFA provider fail.
struct DeviceNodes {
    dev_root: PathBuf,
}

impl Contributor for DeviceNodes {
    fn device_edits(&self, efa: &Efa, edits: &mut Edits) {
        edits.device_nodes.push(DeviceNode {
            container_path: format!("{CONTAINER_NODE_DIR}/{}", efa.uverbs),
            host_path: efa.node_path(&self.dev_root),
            dev: efa.dev,
            permissions: "rw",
        });
    }

    fn container_edits(&self, _: &mut Edits) {}
}

/// The same environment in every container.
struct Environment {
    env: BTreeMap<String, String>,
}

impl Contributor for Environment {
    fn device_edits(&self, _: &Efa, _: &mut Edits) {}

    fn container_edits(&self, edits: &mut Edits) {
        edits
            .env
            .extend(self.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

/// The extra host device nodes (`--extra-device-nodes`, e.g. `/dev/gdrdrv`) as the look-up
/// in `extra_nodes` last found them on the host, each with its own number. Every container with
/// EFAs gets them once; reading them here is the whole cost, as Allocate does no I/O.
#[derive(Clone)]
pub struct FoundNodes(Reader<Arc<[DeviceNode]>>);

impl FoundNodes {
    pub fn new(found: Reader<Arc<[DeviceNode]>>) -> Self {
        FoundNodes(found)
    }

    /// No extra node, as without `--extra-device-nodes`: a snapshot nobody writes.
    pub fn none() -> Self {
        FoundNodes(Writer::new(Arc::from([])).reader())
    }

    /// One item each time the look-up finds something else after this call (a node appears,
    /// goes, or gets another number), for a file that names the nodes, the CDI spec, to be
    /// rendered again; a device-specs answer reads them at each Allocate instead. A look-up
    /// that stops leaves its last result, so this ends only once no one reads the nodes.
    pub fn changes(&self) -> impl Stream<Item = ()> + Send + 'static {
        WatchStream::from_changes(self.0.subscribe()).map(|_| ())
    }
}

impl Contributor for FoundNodes {
    fn device_edits(&self, _: &Efa, _: &mut Edits) {}

    fn container_edits(&self, edits: &mut Edits) {
        edits.device_nodes.extend(self.0.borrow().iter().cloned());
    }
}

/// How an Allocate answer hands the contributors' edits to the runtime.
pub trait Delivery: Send + Sync {
    fn answer(&self, devices: &[Allocated], from: &Contributors) -> ContainerAllocateResponse;
}

/// The device-specs strategy: every edit in the answer itself, which the kubelet passes to the
/// runtime as it is.
pub struct DeviceSpecs;

impl Delivery for DeviceSpecs {
    fn answer(&self, devices: &[Allocated], from: &Contributors) -> ContainerAllocateResponse {
        let mut response = ContainerAllocateResponse::default();
        for device in devices {
            from.device_edits(device.efa).answer(&mut response);
        }
        from.container_edits().answer(&mut response);
        response
    }
}

/// Serves Allocate from the current snapshot.
pub struct Allocator {
    delivery: Box<dyn Delivery>,
    contributors: Contributors,
    sharing: Sharing,
    metrics: Option<Arc<AllocationMetrics>>,
    holdings: Option<Reader<Arc<Holdings>>>,
    recent: Option<Arc<Recent>>,
}

impl Allocator {
    pub fn new(delivery: Box<dyn Delivery>, contributors: Contributors) -> Self {
        Allocator {
            delivery,
            contributors,
            sharing: Sharing::default(),
            metrics: None,
            holdings: None,
            recent: None,
        }
    }

    /// Steers preferred allocations away from the IDs Allocate gave out within `window`, which a
    /// kubelet up to 1.37 may offer again while their pod holds them ([`recent`]).
    pub fn steering_from_recent(mut self, window: std::time::Duration) -> Self {
        self.recent = Some(Arc::new(Recent::new(window)));
        self
    }

    /// The IDs Allocate gave out lately, when it steers by them: shared, for the health
    /// monitor to keep an EFA's ID that a pod may hold before PodResources says so.
    pub fn recent(&self) -> Option<Arc<Recent>> {
        self.recent.clone()
    }

    /// Steers preferred allocations away from EFAs that pods hold under foreign IDs, as the
    /// background PodResources view last saw them.
    pub fn with_holdings(mut self, holdings: Reader<Arc<Holdings>>) -> Self {
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
        // Only the offered IDs are weighed, so only they are looked up.
        let offered = request
            .container_requests
            .iter()
            .flat_map(|offer| &offer.available_device_i_ds)
            .map(String::as_str);
        let given = self
            .recent
            .as_ref()
            .map(|recent| recent.among(offered))
            .unwrap_or_default();
        let avoid = Avoid {
            foreign_held: holdings
                .as_ref()
                .map_or(Avoid::NOTHING.foreign_held, |h| &h.foreign_devices),
            just_given: &given.lately,
            just_now: &given.just_now,
        };
        let response = preferred::respond(inventory, self.sharing, avoid, request);
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
        // An answer means every ID resolved to a healthy EFA of the snapshot under this
        // sharing, so each is one the plugin advertises: the record stays within those.
        if let (Ok(_), Some(recent)) = (&answer, &self.recent) {
            for container in &request.container_requests {
                recent.record(&container.devices_ids);
            }
        }
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
            container_responses.push(self.delivery.answer(&devices, &self.contributors));
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::state::{DeviceRecord, Failure, Verdict};
    use crate::testkit::simulate::{Shape, inventory};

    /// The (ID asked by, EFA) pairs `resolve` gives, or its error.
    type Resolved<'a> = Result<Vec<(&'a str, &'a str)>, AllocateError>;

    /// Every way `resolve` maps a container's IDs: each EFA once under the first ID it was
    /// asked by, in the order asked, and the whole request refused at the first ID that is
    /// not a healthy EFA of this node under this sharing.
    #[test]
    fn resolve_maps_ids_to_healthy_efas_once_each() {
        let mut records: Vec<DeviceRecord> = inventory(Shape::P4d).devices().cloned().collect();
        records[1].verdict = Verdict::unhealthy(Failure::DeviceNode, "link down");
        let inventory = Inventory::default().observe(records).0;
        let ids: Vec<&str> = inventory.devices().map(|d| d.efa.id.as_str()).collect();
        let (a, b, c) = (ids[0], ids[1], ids[2]);
        let replica = |id: &str, k: u32| format!("{id}{}{k}", sharing::SEPARATOR);
        let (a0, a1, a2, b1, c0) = (
            replica(a, 0),
            replica(a, 1),
            replica(a, 2),
            replica(b, 1),
            replica(c, 0),
        );
        let (a0, a1, a2, b1, c0) = (&*a0, &*a1, &*a2, &*b1, &*c0);
        let one = Sharing::default();
        let two = Sharing::replicas(NonZeroU32::new(2).unwrap());
        let unknown = |id: &str| Err(AllocateError::Unknown(id.to_owned()));
        let unhealthy = |id: &str| {
            Err(AllocateError::Unhealthy {
                id: id.to_owned(),
                reason: "link down".to_owned(),
            })
        };
        let stranger = "rdmap0s0";
        let cases: [(&str, Sharing, &[&str], Resolved); 12] = [
            ("nothing asked", one, &[], Ok(vec![])),
            ("in the order asked", one, &[c, a], Ok(vec![(c, c), (a, a)])),
            ("an ID twice, its EFA once", one, &[a, a], Ok(vec![(a, a)])),
            (
                "two replicas of an EFA give it once, under the first",
                two,
                &[a1, c0, a0],
                Ok(vec![(a1, a), (c0, c)]),
            ),
            (
                "not an EFA of this node",
                one,
                &[stranger],
                unknown(stranger),
            ),
            (
                "one unknown ID refuses all",
                one,
                &[a, stranger],
                unknown(stranger),
            ),
            ("a bare EFA ID while shared", two, &[a], unknown(a)),
            ("a replica past the count", two, &[a2], unknown(a2)),
            ("a replica ID while unshared", one, &[a0], unknown(a0)),
            (
                "an unhealthy EFA, with its reason",
                one,
                &[a, b],
                unhealthy(b),
            ),
            (
                "an unhealthy EFA under a replica ID",
                two,
                &[b1],
                unhealthy(b1),
            ),
            (
                "the first bad ID is reported",
                one,
                &[b, stranger],
                unhealthy(b),
            ),
        ];
        for (case, sharing, asked, expected) in cases {
            let asked: Vec<String> = asked.iter().map(|id| id.to_string()).collect();
            let resolved = resolve(&inventory, sharing, &asked).map(|devices| {
                devices
                    .iter()
                    .map(|d| (d.id, d.efa.id.as_str()))
                    .collect::<Vec<_>>()
            });
            assert_eq!(resolved, expected, "{case}");
        }
    }
}
