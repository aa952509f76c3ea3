//! The PodResources view: which pod holds which EFA, from the kubelet's PodResources API. It
//! is an input of the plugin, not only of its metrics: GetPreferredAllocation avoids EFAs held
//! under foreign IDs, the health monitor keeps a renamed EFA's held ID, the CDI spec keeps held
//! foreign names and stays on exit while a pod holds an EFA, and the metrics label traffic with
//! its pod. It also finds EFAs the kubelet gave to two pods (`double_booking`).
//!
//! Polled in the background every rescan interval with a short deadline, into a
//! [`Holdings`] snapshot that scrapes and GetPreferredAllocation read without waiting: a slow or
//! absent kubelet costs the labels and the foreign-ID view, never a scrape or an allocation.
//!
//! A failed poll keeps the last answer, marked stale, for [`STALE_LIMIT`]: the kubelet's rate
//! limiter, a slow answer or a kubelet restart must not make GetPreferredAllocation hand out
//! EFAs that pods hold under foreign IDs. Past it the view is no longer known, but it is never
//! "nobody holds anything": the last known holders stay in it, so every reader keeps steering by
//! them (GetPreferredAllocation, the CDI spec's held names, the gauges), and the readers that need
//! certainty (`health`'s held IDs, the spec kept on exit) treat every ID as possibly held.

mod answer;
mod double_booking;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http::uri::PathAndQuery;

use crate::allocation::sharing::{self, Sharing};
use crate::proto::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use crate::rescan::Rescans;
use crate::state::{DeviceReader, ForeignHold, Holder, Holdings, Inventory, Writer};
use crate::uds;
use double_booking::{Confirmed, Warned, detect};

/// What the view holds per advertised ID at its peak with every ID held (the start-up budget,
/// `service::budget`, counts it): the
/// kubelet's answer, received and decoded (a string per ID), and the view derived from it next
/// to the one it replaces (an entry per EFA and container, the container's names shared by all
/// its IDs). `benches/memory.rs`: 600 EFAs × 64 in cdi mode, every replica held by 64 pods with
/// the longest names, through a flap and a GetPreferredAllocation, peaked 1.1 MiB over the
/// same without holders (3.9 MiB in the worst of three runs: 30 to 106 bytes per ID).
pub(crate) const PEAK_BYTES_PER_ID: usize = 160;

/// How long one poll waits for the kubelet's answer.
pub(crate) const LIST_TIMEOUT: Duration = Duration::from_secs(1);

/// The largest answer read; a larger one fails the poll. gRPC's default receive limit, which
/// the kubelet's own PodResources client keeps too, far above a real node's answer (a p5
/// shared 64 ways, every ID held by pods with the longest names: 120 kB as the kubelet lists
/// it). It bounds the bytes only: decoded, they may take 75 times as much, so `answer` checks
/// what they hold before they are decoded.
pub(crate) const MAX_ANSWER: usize = 4 << 20;

/// How long the last good answer stands in for failed polls (at least two rescan intervals).
/// The kubelet's rate limiter (100 calls a second, a burst of 10) refuses for milliseconds, and
/// a restarting kubelet serves PodResources again from its checkpoint within seconds, with the
/// same holders. The view errs only one way while it is kept: foreign IDs come from pods of a
/// previous plugin or strategy, which the kubelet never hands out again, so while the kubelet
/// cannot be asked they can only end, and an EFA avoided a while too long costs a preference,
/// where one forgotten is given to a second pod. Five minutes is the control plane's default
/// for evicting the pods of a node whose kubelet stays away (`NotReady`/`Unreachable`
/// tolerations of 300 s): past it the holders may be gone, and the view says it cannot tell.
pub(crate) const STALE_LIMIT: Duration = Duration::from_secs(300);

pub(crate) struct PodResources {
    socket: PathBuf,
    resource_name: String,
    /// Whether the last lookup worked, so a failure is logged when it starts, not per poll.
    last_ok: Option<bool>,
}

impl PodResources {
    pub(crate) fn new(socket: PathBuf, resource_name: String) -> Self {
        PodResources {
            socket,
            resource_name,
            last_ok: None,
        }
    }

    /// The kubelet's answer; `None` when it cannot tell.
    async fn poll(&mut self) -> Option<ListPodResourcesResponse> {
        // A missing socket (a typo, a missing mount, a kubelet restarting) is a failed poll like
        // any other, logged when it starts: silent, it would leave double-booking detection,
        // foreign-ID steering and the pod labels off on a node that looks fine.
        let outcome = if self.socket.exists() {
            match tokio::time::timeout(LIST_TIMEOUT, self.list()).await {
                Ok(result) => result,
                Err(_) => Err(format!("no answer within {LIST_TIMEOUT:?}")),
            }
        } else {
            Err("no such socket (is the kubelet's pod-resources dir mounted?)".to_owned())
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
                        "cannot list pod resources; a view the kubelet gave is kept, stale, and after 5 minutes its holders are kept as unknown; without one, who holds which EFA is unknown until it answers"
                    );
                }
                self.last_ok = Some(false);
                None
            }
        }
    }

    /// Calls `List` as the generated client would, but takes the answer as bytes, to check what
    /// it holds before decoding it (`answer`).
    async fn list(&self) -> Result<ListPodResourcesResponse, String> {
        let channel = uds::dial(&self.socket)
            .await
            .map_err(|err| format!("connecting: {err}"))?;
        let mut client = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_ANSWER);
        client
            .ready()
            .await
            .map_err(|err| format!("List: Service was not ready: {err}"))?;
        let bytes = client
            .unary(
                tonic::Request::new(ListPodResourcesRequest {}),
                PathAndQuery::from_static("/v1.PodResourcesLister/List"),
                answer::Raw,
            )
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| format!("List: {}", status.message()))?;
        answer::decode(bytes)
    }

    /// Asks the kubelet now, for a decision that must not rest on a poll one interval old. A
    /// failed poll gives a view that is not `known`, which no reader takes for "nobody holds
    /// anything".
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
        holdings: Writer<Arc<Holdings>>,
        shutdown: CancellationToken,
    ) {
        let mut view = View::new(STALE_LIMIT.max(interval * 2));
        let mut double_booked = Confirmed::default();
        let mut warned_double = Warned::default();
        let mut rescans = Rescans::every(interval, shutdown);
        loop {
            let inventory = state.current();
            let answer = self.poll().await.map(|response| {
                // One map of names serves both readings of the answer.
                let names = Names::of(&inventory);
                let mut next =
                    derive_named(&response, &self.resource_name, &inventory, &names, sharing);
                let found = detect(
                    &response,
                    &self.resource_name,
                    |id| names.device_of(id),
                    sharing,
                );
                next.double_booked = double_booked.observe(&found);
                warned_double.warn(&next.double_booked);
                next
            });
            let current = holdings.borrow().clone();
            if let Some(next) = view.after(answer, &current, &inventory, Instant::now()) {
                holdings.send_replace(Arc::new(next));
            }
            if !rescans.due().await {
                return;
            }
        }
    }
}

/// What the background view shows after each poll, and whom it has warned of.
struct View {
    /// How long the last good answer is kept over failed polls.
    trust: Duration,
    last_good: Option<Instant>,
    warned: BTreeSet<Pod>,
    warned_dra: BTreeSet<Pod>,
}

impl View {
    fn new(trust: Duration) -> Self {
        View {
            trust,
            last_good: None,
            warned: BTreeSet::new(),
            warned_dra: BTreeSet::new(),
        }
    }

    /// The view to publish after a poll that got `answer` (`None`: the kubelet could not be
    /// asked), if it differs from `current`. Warnings follow what the kubelet said, so a view
    /// it could not give forgets no pod: one that recovers warns of no pod again. Past the trust
    /// limit the view is no longer `known` but keeps its last holders, still `stale`: unknown
    /// is never "nothing held".
    fn after(
        &mut self,
        answer: Option<Holdings>,
        current: &Holdings,
        inventory: &Inventory,
        now: Instant,
    ) -> Option<Holdings> {
        let next = match answer {
            Some(answer) => {
                self.last_good = Some(now);
                answer
            }
            None if self.last_good.is_some_and(|at| now - at <= self.trust) => {
                if current.stale {
                    return None;
                }
                Holdings {
                    stale: true,
                    ..current.clone()
                }
            }
            None => {
                if current.known {
                    tracing::warn!(
                        trust = ?self.trust,
                        "the kubelet's PodResources has not answered for too long: who holds which EFA is unknown (efa_device_plugin_pod_resources_unknown 1) until it answers; the last known holders are kept, and renamed EFAs keep their IDs"
                    );
                }
                Holdings {
                    known: false,
                    ..current.clone()
                }
            }
        };
        if next.known {
            warn_of_foreign(&next, &mut self.warned);
            warn_of_dra(&next, inventory, &mut self.warned_dra);
        }
        (*current != next).then_some(next)
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
    derive_named(
        response,
        resource_name,
        inventory,
        &Names::of(inventory),
        sharing,
    )
}

/// [`derive`] with the names of `inventory`'s EFAs already mapped.
fn derive_named(
    response: &ListPodResourcesResponse,
    resource_name: &str,
    inventory: &Inventory,
    names: &Names<'_>,
    sharing: Sharing,
) -> Holdings {
    let mut holdings = Holdings {
        known: true,
        ..Holdings::default()
    };
    for pod in &response.pod_resources {
        for container in &pod.containers {
            // Each ID once, however often the answer lists it.
            let ids: BTreeSet<&str> = container
                .devices
                .iter()
                .filter(|d| d.resource_name == resource_name)
                .flat_map(|d| &d.device_ids)
                .map(String::as_str)
                .collect();
            if ids.is_empty() {
                continue;
            }
            let holder = Arc::new(Holder {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                container: container.name.clone(),
            });
            let mut foreign = Vec::new();
            for id in ids {
                let advertised = sharing
                    .parse(id)
                    .is_some_and(|(device, _)| inventory.get(device).is_some());
                let device = names.device_of(id);
                if let Some(device) = device {
                    hold(&mut holdings, device, &holder);
                }
                if !advertised {
                    foreign.push(id.to_owned());
                    holdings.foreign_devices.extend(device.map(str::to_owned));
                }
            }
            if !foreign.is_empty() {
                holdings.foreign.push(ForeignHold {
                    holder,
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

/// Records `holder` as holding `device`, once for the replicas of one EFA it holds in a row.
fn hold(holdings: &mut Holdings, device: &str, holder: &Arc<Holder>) {
    match holdings.holders.get_mut(device) {
        Some(list) if list.last().is_some_and(|last| Arc::ptr_eq(last, holder)) => {}
        Some(list) => list.push(holder.clone()),
        None => {
            holdings
                .holders
                .insert(device.to_owned(), vec![holder.clone()]);
        }
    }
}

/// Every name an EFA may be held under, whichever plugin or strategy gave it out: its ibdev
/// name and its PCI address, each with or without a replica suffix.
struct Names<'a>(BTreeMap<&'a str, &'a str>);

impl<'a> Names<'a> {
    fn of(inventory: &'a Inventory) -> Self {
        let names = inventory.by_name().into_iter();
        Names(
            names
                .map(|(name, record)| (name, record.efa.id.as_str()))
                .collect(),
        )
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
    use crate::allocation::{self, Allocator, DeviceSpecs};
    use crate::discovery::DeviceIdStrategy;
    use crate::proto::deviceplugin::{
        ContainerPreferredAllocationRequest, PreferredAllocationRequest,
    };
    use crate::state::{DeviceState, Reader};
    use crate::testkit::log::Log;
    use crate::testkit::pod_resources_stub::{PodResourcesStub, pod};
    use crate::testkit::simulate::{Shape, inventory_named};

    const EFA: &str = "vpc.amazonaws.com/efa";
    const INTERVAL: Duration = Duration::from_secs(5);
    /// Long enough for a whole poll to start and end after a change.
    const A_POLL: Duration = INTERVAL.saturating_add(LIST_TIMEOUT.saturating_mul(2));

    /// The GetPreferredAllocation answer for 2 of `offered`, as the allocator gives it.
    fn prefer(allocator: &Allocator, state: &DeviceState, offered: &[String]) -> Vec<String> {
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: offered.to_vec(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: 2,
            }],
        };
        let mut answer = allocator.preferred(&state.current(), &request);
        answer.container_responses.remove(0).device_i_ds
    }

    /// Waits (on paused time, polls included) until the view satisfies `ok`.
    async fn view_until(
        holdings: &Reader<Arc<Holdings>>,
        ok: impl FnMut(&Arc<Holdings>) -> bool,
    ) -> Arc<Holdings> {
        let mut view = holdings.subscribe();
        let waited = tokio::time::timeout(STALE_LIMIT * 2, view.wait_for(ok)).await;
        waited.expect("the view in time").unwrap().clone()
    }

    #[test]
    fn a_container_is_named_once_however_many_ids_it_lists() {
        let inventory = inventory_named(Shape::P4d, DeviceIdStrategy::Ibdev);
        let sharing = Sharing::replicas(NonZeroU32::new(4).unwrap());
        // A hostile answer lists one ID of each kind over and over: an advertised replica, a
        // foreign name of the same EFA, and one no EFA here is called.
        let mut listed = vec!["rdmap16s27::1"; 10_000];
        listed.extend(["rdmap32s27::0", "rdmap32s27::3", "0000:10:1b.0"].repeat(10_000));
        listed.extend(vec!["gone"; 10_000]);
        let response = ListPodResourcesResponse {
            pod_resources: vec![pod("ml", "flood", "main", EFA, &listed)],
        };
        let holdings = derive(&response, EFA, &inventory, sharing);
        assert_eq!(holdings.holders.len(), 2);
        let named: Vec<&Arc<Holder>> = holdings.holders.values().flatten().collect();
        assert_eq!(named.len(), 2, "one holder per EFA: {named:?}");
        assert!(Arc::ptr_eq(named[0], named[1]), "and one name for both");
        assert_eq!((holdings.foreign.len(), holdings.foreign_ids()), (1, 2));
        assert_eq!(holdings.foreign[0].ids, ["0000:10:1b.0", "gone"]);
        assert!(Arc::ptr_eq(&holdings.foreign[0].holder, named[0]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_poll_keeps_the_foreign_view_for_preferred_allocations_for_a_while() {
        let log = Log::default();
        let _logging = log.capture();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("pod-resources/kubelet.sock");
        let by_pci = inventory_named(Shape::P4d, DeviceIdStrategy::Pci);
        let efas: Vec<_> = by_pci.devices().map(|r| r.efa.clone()).collect();
        // A pod started under the AWS plugin holds the two NUMA-0 EFAs by their ibdev names.
        let pods = vec![pod(
            "ml",
            "aws",
            "main",
            EFA,
            &[&efas[0].ibdev, &efas[1].ibdev],
        )];
        let mut kubelet = PodResourcesStub::start(&socket, pods.clone()).unwrap();
        let state = DeviceState::unguarded();
        state.apply(by_pci.devices().cloned().collect());
        let writer = Writer::<Arc<Holdings>>::default();
        let holdings = writer.reader();
        let shutdown = CancellationToken::new();
        let poller = tokio::spawn(PodResources::new(socket.clone(), EFA.into()).run(
            state.reader(),
            Sharing::default(),
            INTERVAL,
            writer,
            shutdown.clone(),
        ));
        let contributors =
            allocation::contributors(dir.path(), &BTreeMap::new(), allocation::FoundNodes::none());
        let allocator =
            Allocator::new(Box::new(DeviceSpecs), contributors).with_holdings(holdings.clone());
        let offered: Vec<String> = efas.iter().map(|e| e.id.clone()).collect();
        let free = [efas[2].id.clone(), efas[3].id.clone()];

        let fresh = view_until(&holdings, |v| v.known).await;
        assert_eq!((fresh.foreign_ids(), fresh.stale), (2, false));
        assert_eq!(prefer(&allocator, &state, &offered), free);

        // The kubelet's rate limiter, an answer past the deadline, a kubelet restart that
        // takes its socket away for a while: each keeps the last view, marked stale.
        for blip in ["rate-limited", "slow"] {
            match blip {
                "rate-limited" => kubelet.refuse(tonic::Code::ResourceExhausted),
                _ => kubelet.stall(),
            }
            tokio::time::sleep(A_POLL).await;
            assert_eq!(prefer(&allocator, &state, &offered), free, "{blip}");
            let stale = holdings.borrow().clone();
            assert!(stale.stale, "{blip}: {stale:?}");
            assert_eq!((stale.known, stale.foreign_ids()), (true, 2), "{blip}");
            assert_eq!(stale.holders, fresh.holders, "{blip}");
            kubelet.recover();
            assert_eq!(*view_until(&holdings, |v| !v.stale).await, *fresh, "{blip}");
        }
        drop(kubelet);
        std::fs::remove_file(&socket).unwrap();
        tokio::time::sleep(A_POLL).await;
        assert_eq!(prefer(&allocator, &state, &offered), free, "restarting");
        assert!(holdings.borrow().stale);
        kubelet = PodResourcesStub::start(&socket, pods.clone()).unwrap();
        assert_eq!(*view_until(&holdings, |v| !v.stale).await, *fresh);

        // A kubelet away for longer than the view is trusted leaves it unknown, never empty:
        // the last holders stay, still stale, preferred allocations still avoid them, and one
        // line says so. Its return brings the same pods back, of whom no one is warned again.
        kubelet.refuse(tonic::Code::ResourceExhausted);
        let since = Instant::now();
        view_until(&holdings, |v| v.stale).await;
        let unknown = view_until(&holdings, |v| !v.known).await;
        assert!(since.elapsed() > STALE_LIMIT, "{:?}", since.elapsed());
        assert!(unknown.stale, "the outage goes on: {unknown:?}");
        assert_eq!(unknown.holders, fresh.holders);
        assert_eq!(unknown.foreign, fresh.foreign);
        assert_eq!(unknown.foreign_devices, fresh.foreign_devices);
        tokio::time::sleep(A_POLL * 3).await;
        assert_eq!(prefer(&allocator, &state, &offered), free, "unknown");
        let said_unknown = |log: &Log| {
            log.warnings()
                .into_iter()
                .filter(|line| line.contains("has not answered for too long"))
                .count()
        };
        assert_eq!(said_unknown(&log), 1, "{:#?}", log.warnings());
        kubelet.recover();
        assert_eq!(*view_until(&holdings, |v| v.known).await, *fresh);
        let warned: Vec<String> = log
            .warnings()
            .into_iter()
            .filter(|line| line.contains("IDs this plugin does not advertise"))
            .collect();
        assert_eq!(warned.len(), 1, "{warned:#?}");

        shutdown.cancel();
        poller.await.unwrap();
    }

    fn holder(pod: &str) -> Arc<Holder> {
        Arc::new(Holder {
            namespace: "ml".into(),
            pod: pod.into(),
            container: "main".into(),
        })
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
    fn a_renamed_efa_is_held_under_the_old_id_it_keeps() {
        let inventory = inventory_named(Shape::P4d, DeviceIdStrategy::Ibdev);
        let mut renamed: Vec<_> = inventory.devices().cloned().collect();
        renamed[0].efa.id = "efa_0".into();
        renamed[0].efa.ibdev = "efa_0".into();
        // Held, so the EFA stays `rdmap144s27` although sysfs now calls it `efa_0`.
        let (inventory, _) = inventory.observe(renamed);
        assert_eq!(inventory.get("rdmap144s27").unwrap().efa.ibdev, "efa_0");
        let response = ListPodResourcesResponse {
            pod_resources: vec![pod("ml", "trainer-0", "main", EFA, &["rdmap144s27"])],
        };
        let holdings = derive(&response, EFA, &inventory, Sharing::default());
        assert_eq!(holdings.holders["rdmap144s27"], [holder("trainer-0")]);
        assert!(holdings.foreign.is_empty(), "{holdings:?}");
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
