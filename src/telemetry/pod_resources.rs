//! Which pod holds which EFA, from the kubelet's PodResources API: to label traffic with its
//! pod, to find IDs the kubelet counts as free although a pod holds their EFA, and to find EFAs
//! it gave to two pods (`double_booking`).
//!
//! Polled in the background every rescan interval with a short deadline, into a
//! [`Holdings`] snapshot that scrapes and GetPreferredAllocation read without waiting: a slow or
//! absent kubelet costs the labels and the foreign-ID view, never a scrape or an allocation.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::double_booking::{Confirmed, Warned, detect};
use crate::allocation::sharing::{self, Sharing};
use crate::proto::podresources::{
    ListPodResourcesRequest, ListPodResourcesResponse,
    pod_resources_lister_client::PodResourcesListerClient,
};
use crate::rescan::Rescans;
use crate::state::{DeviceReader, ForeignHold, Holder, Holdings, Inventory};
use crate::uds;

/// How long one poll waits for the kubelet's answer.
pub(crate) const LIST_TIMEOUT: Duration = Duration::from_secs(1);

pub struct PodResources {
    socket: PathBuf,
    resource_name: String,
    /// Whether the last lookup worked, so a failure is logged when it starts, not per poll.
    last_ok: Option<bool>,
}

impl PodResources {
    pub fn new(socket: PathBuf, resource_name: String) -> Self {
        PodResources {
            socket,
            resource_name,
            last_ok: None,
        }
    }

    /// The kubelet's answer; `None` when it cannot tell.
    async fn poll(&mut self) -> Option<ListPodResourcesResponse> {
        // Without the socket (not mounted, or no kubelet) the view is simply empty.
        if !self.socket.exists() {
            return None;
        }
        let outcome = match tokio::time::timeout(LIST_TIMEOUT, self.list()).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {LIST_TIMEOUT:?}")),
        };
        match outcome {
            Ok(response) => {
                if self.last_ok == Some(false) {
                    tracing::info!(socket = %self.socket.display(), "pod resources can be listed again");
                }
                self.last_ok = Some(true);
                Some(response)
            }
            Err(err) => {
                if self.last_ok != Some(false) {
                    tracing::warn!(
                        socket = %self.socket.display(),
                        error = %err,
                        "cannot list pod resources; no efa_device_allocation series and foreign IDs go unseen"
                    );
                }
                self.last_ok = Some(false);
                None
            }
        }
    }

    async fn list(&self) -> Result<ListPodResourcesResponse, String> {
        let channel = uds::dial(&self.socket)
            .await
            .map_err(|err| format!("connecting: {err}"))?;
        PodResourcesListerClient::new(channel)
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| format!("List: {}", status.message()))
    }

    /// Asks the kubelet now, for a decision that must not rest on a poll one interval old.
    pub(crate) async fn holdings_now(
        mut self,
        inventory: &Inventory,
        sharing: Sharing,
    ) -> Holdings {
        match self.poll().await {
            Some(response) => derive(&response, &self.resource_name, inventory, sharing),
            None => Holdings::default(),
        }
    }

    /// Keeps `holdings` current until `shutdown`: a poll at once, then every `interval`.
    /// Warns once per pod that holds foreign IDs, while it holds them.
    pub(crate) async fn run(
        mut self,
        state: DeviceReader,
        sharing: Sharing,
        interval: Duration,
        holdings: Arc<watch::Sender<Arc<Holdings>>>,
        shutdown: CancellationToken,
    ) {
        let mut warned: BTreeSet<Pod> = BTreeSet::new();
        let mut warned_dra: BTreeSet<Pod> = BTreeSet::new();
        let mut double_booked = Confirmed::default();
        let mut warned_double = Warned::default();
        let mut rescans = Rescans::every(interval, shutdown);
        loop {
            let inventory = state.current();
            let next = match self.poll().await {
                Some(response) => {
                    let mut next = derive(&response, &self.resource_name, &inventory, sharing);
                    let names = Names::of(&inventory);
                    let found = detect(
                        &response,
                        &self.resource_name,
                        |id| names.device_of(id),
                        sharing,
                    );
                    next.double_booked = double_booked.observe(&found);
                    warned_double.warn(&next.double_booked);
                    next
                }
                None => Holdings::default(),
            };
            warn_of_foreign(&next, &mut warned);
            warn_of_dra(&next, &inventory, &mut warned_dra);
            holdings.send_if_modified(|now| {
                let changed = **now != next;
                if changed {
                    *now = Arc::new(next);
                }
                changed
            });
            if !rescans.due().await {
                return;
            }
        }
    }
}

/// A pod, as (namespace, name).
type Pod = (String, String);

/// The pods of `by_pod` that `warned` lacks; `warned` then holds exactly `by_pod`'s pods, so a
/// pod that drops out and comes back is new again.
fn first_seen<T>(by_pod: BTreeMap<Pod, T>, warned: &mut BTreeSet<Pod>) -> Vec<(Pod, T)> {
    let seen = by_pod.keys().cloned().collect();
    let new = by_pod
        .into_iter()
        .filter(|(pod, _)| !warned.contains(pod))
        .collect();
    *warned = seen;
    new
}

/// One warning per pod when it is first seen holding foreign IDs; a pod that stops holding
/// them and starts again is warned of again.
fn warn_of_foreign(holdings: &Holdings, warned: &mut BTreeSet<Pod>) {
    let mut by_pod: BTreeMap<Pod, Vec<&str>> = BTreeMap::new();
    for hold in &holdings.foreign {
        let pod = (hold.holder.namespace.clone(), hold.holder.pod.clone());
        by_pod
            .entry(pod)
            .or_default()
            .extend(hold.ids.iter().map(String::as_str));
    }
    for ((namespace, pod), ids) in first_seen(by_pod, warned) {
        tracing::warn!(
            %namespace,
            %pod,
            ids = %ids.join(","),
            "a pod holds EFAs under IDs this plugin does not advertise; the kubelet counts those EFAs as free, so preferred allocations avoid them"
        );
    }
}

/// One warning per pod that holds EFAs through this plugin while a DRA driver is registered,
/// naming the pod to drain: the driver cannot see its EFAs and may give them to another pod.
/// Per pod rather than once per conflict, because the view may first answer after the conflict
/// began, and a conflict that ends and starts again warns of every pod again.
fn warn_of_dra(holdings: &Holdings, inventory: &Inventory, warned: &mut BTreeSet<Pod>) {
    for ((namespace, pod), ids) in first_seen(holdings.pods_unseen_by_dra(inventory), warned) {
        tracing::warn!(
            %namespace,
            %pod,
            ids = %ids.join(","),
            "a pod holds EFAs through this plugin while an EFA DRA driver is registered; the driver cannot see them and may allocate them to another pod: drain it before handing the node to DRA"
        );
    }
}

/// What `response` says about `resource_name`'s devices in `inventory`: who holds each one,
/// under an advertised ID or another name of the same EFA, and which held IDs are foreign.
pub(crate) fn derive(
    response: &ListPodResourcesResponse,
    resource_name: &str,
    inventory: &Inventory,
    sharing: Sharing,
) -> Holdings {
    let names = Names::of(inventory);
    let mut holdings = Holdings {
        known: true,
        ..Holdings::default()
    };
    for pod in &response.pod_resources {
        for container in &pod.containers {
            let holder = Holder {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                container: container.name.clone(),
            };
            let mut foreign = Vec::new();
            let ids = container
                .devices
                .iter()
                .filter(|d| d.resource_name == resource_name)
                .flat_map(|d| &d.device_ids);
            for id in ids {
                let advertised = sharing
                    .parse(id)
                    .is_some_and(|(device, _)| inventory.get(device).is_some());
                let device = names.device_of(id);
                if let Some(device) = device {
                    holdings
                        .holders
                        .entry(device.to_owned())
                        .or_default()
                        .push(holder.clone());
                }
                if !advertised {
                    foreign.push(id.clone());
                    holdings.foreign_devices.extend(device.map(str::to_owned));
                }
            }
            if !foreign.is_empty() {
                holdings.foreign.push(ForeignHold {
                    holder: holder.clone(),
                    ids: foreign,
                });
            }
        }
    }
    for list in holdings.holders.values_mut() {
        list.sort();
        list.dedup();
    }
    holdings
}

/// Every name an EFA may be held under, whichever plugin or strategy gave it out: its ibdev
/// name and its PCI address, each with or without a replica suffix.
struct Names<'a>(BTreeMap<&'a str, &'a str>);

impl<'a> Names<'a> {
    fn of(inventory: &'a Inventory) -> Self {
        let mut names = BTreeMap::new();
        for record in inventory.devices() {
            let efa = &record.efa;
            names.insert(efa.ibdev.as_str(), efa.id.as_str());
            names.insert(efa.pci_address.as_str(), efa.id.as_str());
        }
        Names(names)
    }

    /// The advertised device id an ID maps to, if any.
    fn device_of(&self, id: &str) -> Option<&'a str> {
        self.0.get(sharing::device_of(id)).copied()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::discovery::DeviceIdStrategy;
    use crate::testkit::pod_resources_stub::pod;
    use crate::testkit::simulate::{Shape, inventory_named};

    const EFA: &str = "vpc.amazonaws.com/efa";

    fn holder(pod: &str) -> Holder {
        Holder {
            namespace: "ml".into(),
            pod: pod.into(),
            container: "main".into(),
        }
    }

    #[test]
    fn a_pod_is_new_until_seen_and_again_after_it_dropped_out() {
        let pods = |names: &[&str]| -> BTreeMap<Pod, ()> {
            names
                .iter()
                .map(|n| (("ml".to_owned(), (*n).to_owned()), ()))
                .collect()
        };
        let names = |new: Vec<(Pod, ())>| -> Vec<String> {
            new.into_iter().map(|((_, pod), ())| pod).collect()
        };
        let mut warned = BTreeSet::new();
        assert_eq!(
            names(first_seen(pods(&["p1", "p2"]), &mut warned)),
            ["p1", "p2"]
        );
        assert!(first_seen(pods(&["p1", "p2"]), &mut warned).is_empty());
        assert!(first_seen(pods(&["p2"]), &mut warned).is_empty());
        assert_eq!(names(first_seen(pods(&["p1", "p2"]), &mut warned)), ["p1"]);
        assert!(first_seen(pods(&[]), &mut warned).is_empty());
        assert_eq!(names(first_seen(pods(&["p2"]), &mut warned)), ["p2"]);
    }

    #[test]
    fn maps_our_devices_and_shared_ids_to_their_holders() {
        let inventory = inventory_named(Shape::P4d, DeviceIdStrategy::Ibdev);
        let sharing = Sharing::replicas(NonZeroU32::new(2).unwrap());
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "trainer-0", "main", EFA, &["rdmap16s27::0"]),
                pod(
                    "ml",
                    "gpu-only",
                    "main",
                    "nvidia.com/gpu",
                    &["rdmap32s27::0"],
                ),
                pod("ml", "sidecar", "main", EFA, &["rdmap144s27::1"]),
                pod("ml", "other", "main", EFA, &["rdmap144s27::0"]),
            ],
        };
        let holdings = derive(&response, EFA, &inventory, sharing);
        assert!(holdings.known);
        assert_eq!(holdings.holders.len(), 2, "{holdings:?}");
        assert_eq!(holdings.holders["rdmap16s27"], [holder("trainer-0")]);
        assert_eq!(
            holdings.holders["rdmap144s27"],
            [holder("other"), holder("sidecar")]
        );
        assert!(holdings.foreign.is_empty() && holdings.foreign_devices.is_empty());
    }

    #[test]
    fn ids_this_plugin_does_not_advertise_are_foreign_and_mapped_to_their_efa() {
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                // The AWS plugin's IDs, the other strategy's, another sharing count's, and
                // something no EFA on this node is called.
                pod("ml", "aws", "main", EFA, &["rdmap16s27", "rdmap32s27"]),
                pod("ml", "shared", "main", EFA, &["0000:90:1b.0::3"]),
                pod("ml", "stale", "main", EFA, &["0000:ff:00.0"]),
            ],
        };
        let by_pci = inventory_named(Shape::P4d, DeviceIdStrategy::Pci);
        let holdings = derive(&response, EFA, &by_pci, Sharing::default());
        assert_eq!(holdings.foreign_ids(), 4);
        assert_eq!(holdings.foreign[0].holder, holder("aws"));
        assert_eq!(holdings.foreign[0].ids, ["rdmap16s27", "rdmap32s27"]);
        assert_eq!(
            holdings.foreign_devices.iter().collect::<Vec<_>>(),
            ["0000:10:1b.0", "0000:20:1b.0", "0000:90:1b.0"]
        );
        // Their pods still label the EFAs they hold.
        assert_eq!(holdings.holders["0000:10:1b.0"], [holder("aws")]);
        assert_eq!(holdings.holders["0000:90:1b.0"], [holder("shared")]);

        // Under ibdev IDs, the AWS plugin's IDs are this plugin's own.
        let by_ibdev = inventory_named(Shape::P4d, DeviceIdStrategy::Ibdev);
        let holdings = derive(&response, EFA, &by_ibdev, Sharing::default());
        let foreign: Vec<&str> = holdings
            .foreign
            .iter()
            .map(|f| f.holder.pod.as_str())
            .collect();
        assert_eq!(foreign, ["shared", "stale"]);
        assert_eq!(
            holdings.foreign_devices.iter().collect::<Vec<_>>(),
            ["rdmap144s27"]
        );
    }
}
