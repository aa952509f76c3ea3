//! Devices that containers of two different pods hold at once, from the kubelet's PodResources
//! answer: what kubernetes PR #137534 (every kubelet up to 1.37) lets happen when a reservation
//! in flight is dropped, what two allocators of one EFA do, and what replica IDs do once the
//! plugin stops sharing an EFA while pods hold them.
//!
//! A device is counted by EFA, whatever form of its ID each pod holds (ibdev name or PCI address,
//! with or without a replica suffix): two pods with one EFA under two strategies, after a
//! migration, are in the same danger. Under sharing, by replica: two pods with different
//! replicas of one EFA is what sharing is for, two pods with the same replica is not. Containers
//! of one pod are one holder: the kubelet hands an init container's devices on to the app
//! containers.
//!
//! What the kubelet lists, and why a correct kubelet never shows one device in two pods, is in
//! docs/operations.md (#double-bookings). One answer can still tear: `List` reads each
//! container's devices separately, so a pod that ends during the call may be read with a device
//! that a pod admitted meanwhile is read with too. A torn read does not survive the next answer,
//! a real double booking does, so [`Confirmed`] reports only the pods of a device that two
//! answers in a row show.
//!
//! The kubelet tracks IDs, not EFAs: without sharing, pods holding different IDs of one EFA,
//! replica IDs among them, got those under an earlier `--sharing-replicas` count, which the
//! kubelet counts as devices of their own ([`Cause::SharingChanged`]). That ends with those
//! pods, and no kubelet upgrade prevents it.
//!
//! A kubelet may list one ID in every pod of an answer as large as `MAX_ANSWER`, so each step
//! is linear in the answer, bar a sort: a device is confirmed and warned of by its pods, never
//! by pairs of them. [`Warned`] warns once per device while its booking lasts, naming at most
//! [`MAX_NAMED`] pods, again when a pod joins it or it comes back, and of at most
//! [`MAX_WARNED`] devices per answer.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::Arc;

use crate::allocation::sharing::{self, Sharing};
use crate::proto::podresources::ListPodResourcesResponse;
use crate::state::{Cause, DoubleBooking};

/// A pod, as (namespace, name).
type Pod = (String, String);

/// A pod as the answer names it.
type PodRef<'a> = (&'a str, &'a str);

/// The most pods, and IDs, one warning names; it counts the rest.
const MAX_NAMED: usize = 8;

/// The most devices warned of one by one after an answer; one more line counts the rest.
const MAX_WARNED: usize = 16;

/// One device that containers of two or more pods hold in one answer.
#[derive(Debug, PartialEq)]
pub(crate) struct Found<'a> {
    device: String,
    /// Sorted, each once.
    pods: Vec<PodRef<'a>>,
    cause: Cause,
}

/// One ID the answer lists under the resource, and the device it counts as. Sorted, the IDs
/// of a device are together, and the pods of an ID.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Listed<'a> {
    efa: &'a str,
    /// Under sharing, the replica.
    replica: Option<&'a str>,
    id: &'a str,
    /// The index of the pod in the answer.
    pod: usize,
}

/// Every device of `resource_name` that containers of two or more pods hold in `response`,
/// sorted. `efa_of` maps a held ID (any name of an EFA, with or without a replica suffix) to the
/// EFA's advertised device id, `None` for no EFA on this node (the ID then counts as itself).
pub(crate) fn detect<'a, 'n: 'a>(
    response: &'a ListPodResourcesResponse,
    resource_name: &str,
    efa_of: impl Fn(&str) -> Option<&'n str>,
    sharing: Sharing,
) -> Vec<Found<'a>> {
    let mut listed = Distinct::default();
    for (pod, resources) in response.pod_resources.iter().enumerate() {
        let ids = resources
            .containers
            .iter()
            .flat_map(|c| &c.devices)
            .filter(|d| d.resource_name == resource_name)
            .flat_map(|d| &d.device_ids);
        for id in ids {
            let efa = efa_of(id).unwrap_or_else(|| sharing::device_of(id));
            // An unsuffixed ID under sharing was given out exclusively before sharing was on;
            // it is a foreign hold (alerted on its own), not a replica that two pods share.
            let replica = match id.rsplit_once(sharing::SEPARATOR) {
                Some((_, replica)) if sharing.is_shared() => Some(replica),
                _ => None,
            };
            listed.push(Listed {
                efa,
                replica,
                pod,
                id,
            });
        }
    }
    let listed = listed.into_sorted();
    // A pod may be listed twice, under two indices: pods are told apart by name.
    let pod_of = |listed: &Listed<'a>| {
        let pod = &response.pod_resources[listed.pod];
        (pod.namespace.as_str(), pod.name.as_str())
    };
    let mut found: Vec<Found<'a>> = listed
        .chunk_by(|a, b| (a.efa, a.replica) == (b.efa, b.replica))
        .filter(|held| held.iter().any(|h| h.pod != held[0].pod))
        .filter_map(|held| {
            let mut pods: Vec<PodRef<'a>> = held.iter().map(pod_of).collect();
            pods.sort_unstable();
            pods.dedup();
            if pods.len() < 2 {
                return None;
            }
            let (efa, replica) = (held[0].efa, held[0].replica);
            Some(Found {
                device: match replica {
                    Some(replica) => format!("{efa}{}{replica}", sharing::SEPARATOR),
                    None => efa.to_owned(),
                },
                pods,
                cause: cause(held, pod_of, sharing),
            })
        })
        .collect();
    found.sort_unstable_by(|a, b| a.device.cmp(&b.device));
    found
}

/// Why two or more pods hold the device of `held` (its IDs, sorted): one ID in two of them is
/// the kubelet's doing; without sharing, different IDs among which replica IDs are the sharing
/// change's.
fn cause<'a>(
    held: &[Listed<'a>],
    pod_of: impl Fn(&Listed<'a>) -> PodRef<'a>,
    sharing: Sharing,
) -> Cause {
    if sharing.is_shared() {
        return Cause::Kubelet;
    }
    let (mut ids, mut replicas) = (Vec::new(), 0);
    for holders in held.chunk_by(|a, b| a.id == b.id) {
        if holders.iter().any(|h| pod_of(h) != pod_of(&holders[0])) {
            return Cause::Kubelet;
        }
        let id = holders[0].id;
        if id.contains(sharing::SEPARATOR) {
            replicas += 1;
            if ids.len() < MAX_NAMED {
                ids.push(id.to_owned());
            }
        }
    }
    if replicas == 0 {
        return Cause::Kubelet;
    }
    Cause::SharingChanged {
        ids,
        held: replicas,
    }
}

/// Items collected sorted and each once, in memory proportional to the distinct items rather
/// than to all pushed: a container may list one ID hundreds of thousands of times.
struct Distinct<T>(Vec<T>);

impl<T> Default for Distinct<T> {
    fn default() -> Self {
        Distinct(Vec::new())
    }
}

impl<T: Ord> Distinct<T> {
    /// Adds `item`, first sorting out the repeats when the buffer is full.
    fn push(&mut self, item: T) {
        let items = &mut self.0;
        if items.len() == items.capacity() {
            items.sort_unstable();
            items.dedup();
            // Growing unless half was repeats keeps the sorts to O(n log n) in all.
            if items.len() > items.capacity() / 2 {
                items.reserve(items.capacity());
            }
        }
        items.push(item);
    }

    fn into_sorted(mut self) -> Vec<T> {
        self.0.sort_unstable();
        self.0.dedup();
        self.0
    }
}

/// The double bookings that two answers in a row show: of each device found, the pods both
/// answers name.
#[derive(Debug, Default)]
pub(crate) struct Confirmed {
    /// The devices the previous answer found, with their pods, sorted.
    previous: BTreeMap<String, Vec<Arc<Pod>>>,
}

impl Confirmed {
    /// Takes the devices found in one answer; returns those whose pods the previous answer
    /// showed too, two or more of them.
    pub(crate) fn observe(&mut self, found: &[Found<'_>]) -> Vec<DoubleBooking> {
        let mut now = BTreeMap::new();
        let mut confirmed = Vec::new();
        for booking in found {
            let before = self
                .previous
                .get(&booking.device)
                .map_or(&[][..], Vec::as_slice);
            let (pods, both) = carry_over(&booking.pods, before);
            if both.len() > 1 {
                confirmed.push(DoubleBooking {
                    device: booking.device.clone(),
                    pods: both,
                    cause: booking.cause.clone(),
                });
            }
            now.insert(booking.device.clone(), pods);
        }
        self.previous = now;
        confirmed
    }
}

/// `pod` as an answer names it, to compare the two.
fn key(pod: &Pod) -> PodRef<'_> {
    (&pod.0, &pod.1)
}

/// `pods` as shared names, those in `before` (sorted too) reused rather than copied again; and
/// those in both.
fn carry_over(pods: &[PodRef<'_>], before: &[Arc<Pod>]) -> (Vec<Arc<Pod>>, Vec<Arc<Pod>>) {
    let mut before = before.iter().peekable();
    let mut all = Vec::with_capacity(pods.len());
    let mut both = Vec::new();
    for &pod in pods {
        while before.next_if(|known| key(known) < pod).is_some() {}
        match before.next_if(|known| key(known) == pod) {
            Some(known) => {
                all.push(Arc::clone(known));
                both.push(Arc::clone(known));
            }
            None => all.push(Arc::new((pod.0.to_owned(), pod.1.to_owned()))),
        }
    }
    (all, both)
}

/// Remembers the pods of each confirmed device warned of, so that a device is warned of once
/// while its booking lasts, again when a pod joins it, and again after it ended and came back.
#[derive(Debug, Default)]
pub(crate) struct Warned(BTreeMap<String, Vec<Arc<Pod>>>);

/// What one answer warns of.
#[derive(Debug, Default)]
struct Warnings<'a> {
    /// Warned of one by one: at most [`MAX_WARNED`].
    named: Vec<&'a DoubleBooking>,
    /// Counted in one line.
    unnamed: usize,
}

impl Warned {
    /// The devices of `confirmed` with a pod not warned of while the booking lasted; `confirmed`
    /// is then what has been warned of.
    fn news<'a>(&mut self, confirmed: &'a [DoubleBooking]) -> Warnings<'a> {
        let mut warnings = Warnings::default();
        let mut now = BTreeMap::new();
        for booking in confirmed {
            let before = self.0.remove(&booking.device).unwrap_or_default();
            if !is_subset(&booking.pods, &before) {
                if warnings.named.len() < MAX_WARNED {
                    warnings.named.push(booking);
                } else {
                    warnings.unnamed += 1;
                }
            }
            now.insert(booking.device.clone(), booking.pods.clone());
        }
        self.0 = now;
        warnings
    }

    /// One warning per device of `confirmed` with a pod not warned of while it lasted, for at
    /// most [`MAX_WARNED`] devices, and one line counting the others.
    pub(crate) fn warn(&mut self, confirmed: &[DoubleBooking]) {
        let Warnings { named, unnamed } = self.news(confirmed);
        for booking in named {
            warn_of(booking);
        }
        if unnamed > 0 {
            tracing::warn!(
                devices = unnamed,
                "more EFAs are double-booked than are warned of one by one; \
                 efa_device_plugin_double_booked_devices counts every one"
            );
        }
    }
}

/// Whether every pod of `pods` is in `of`, both sorted.
fn is_subset(pods: &[Arc<Pod>], of: &[Arc<Pod>]) -> bool {
    let mut of = of.iter().peekable();
    pods.iter().all(|pod| {
        while of.next_if(|known| *known < pod).is_some() {}
        of.next_if(|known| *known == pod).is_some()
    })
}

/// Warns of `booking`, with what caused it and what to do.
fn warn_of(booking: &DoubleBooking) {
    let device = &booking.device;
    let (pods, more_pods) = first_named(
        booking.pods.len(),
        booking
            .pods
            .iter()
            .map(|pod| format!("{}/{}", pod.0, pod.1)),
    );
    match &booking.cause {
        Cause::Kubelet => tracing::warn!(
            %device,
            %pods,
            more_pods,
            "an EFA is double-booked: the kubelet lists it in two or more running pods at once \
             (kubernetes PR #137534, every kubelet up to 1.37); delete all but one of the pods \
             and upgrade the kubelet"
        ),
        Cause::SharingChanged { ids, held } => {
            let (ids, more_ids) = first_named(*held, ids.iter());
            tracing::warn!(
                %device,
                %pods,
                more_pods,
                %ids,
                more_ids,
                "an EFA is double-booked by a --sharing-replicas change: pods hold replica IDs \
                 of it given out under another sharing count, so they share it while this \
                 plugin no longer does, and the kubelet counts those IDs apart from the EFA it \
                 now gives out whole; it ends when those pods do: drain them (no kubelet fault)"
            );
        }
    }
}

/// The first [`MAX_NAMED`] of `total` items, comma-separated, and how many are left out.
fn first_named(total: usize, items: impl Iterator<Item = impl Display>) -> (String, usize) {
    let named: Vec<String> = items.take(MAX_NAMED).map(|item| item.to_string()).collect();
    let left_out = total - named.len();
    (named.join(","), left_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::sharing::shared;
    use crate::holdings::MAX_ANSWER;
    use crate::proto::podresources::{ContainerDevices, ContainerResources, PodResources};
    use crate::testkit::log::Log;
    use crate::testkit::pod_resources_stub::pod;

    const EFA: &str = "vpc.amazonaws.com/efa";

    /// The names of a two-EFA node with ibdev IDs: both names of each EFA, as the inventory has
    /// them.
    fn efa_of(id: &str) -> Option<&'static str> {
        match sharing::device_of(id) {
            "rdmap16s27" | "0000:10:1b.0" => Some("rdmap16s27"),
            "rdmap32s27" | "0000:20:1b.0" => Some("rdmap32s27"),
            _ => None,
        }
    }

    /// A pod whose containers hold the given IDs, one container each.
    fn pod_of(name: &str, containers: &[(&str, &[&str])]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: "ml".into(),
            containers: containers
                .iter()
                .map(|(container, ids)| ContainerResources {
                    name: (*container).into(),
                    devices: vec![ContainerDevices {
                        resource_name: EFA.into(),
                        device_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
                        topology: None,
                    }],
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// `device` found in the pods named, of namespace `ml`.
    fn found(device: &str, pods: &[&'static str], cause: Cause) -> Found<'static> {
        Found {
            device: device.into(),
            pods: pods.iter().map(|pod| ("ml", *pod)).collect(),
            cause,
        }
    }

    fn by_kubelet(device: &str, pods: &[&'static str]) -> Found<'static> {
        found(device, pods, Cause::Kubelet)
    }

    fn booked(device: &str, pods: &[&str]) -> DoubleBooking {
        DoubleBooking {
            device: device.into(),
            pods: pods
                .iter()
                .map(|pod| Arc::new(("ml".into(), (*pod).into())))
                .collect(),
            cause: Cause::Kubelet,
        }
    }

    /// `answer` read in `answers` polls in a row, as the poller reads it, with what was logged.
    fn poll(answer: &ListPodResourcesResponse, answers: usize) -> (Vec<DoubleBooking>, Log) {
        let log = Log::default();
        let _guard = log.capture();
        let (mut confirmed, mut warned) = (Confirmed::default(), Warned::default());
        let mut bookings = Vec::new();
        for _ in 0..answers {
            bookings = confirmed.observe(&detect(answer, EFA, efa_of, Sharing::default()));
            warned.warn(&bookings);
        }
        (bookings, log)
    }

    #[test]
    fn counts_pods_per_efa_or_replica() {
        struct Case {
            name: &'static str,
            sharing: Sharing,
            pods: Vec<PodResources>,
            want: Vec<Found<'static>>,
        }
        let one = |name, ids: &'static [&'static str]| pod("ml", name, "main", EFA, ids);
        let sharing_changed = |device, pods, ids: &[&str]| {
            let cause = Cause::SharingChanged {
                ids: ids.iter().map(|id| (*id).to_owned()).collect(),
                held: ids.len(),
            };
            found(device, pods, cause)
        };
        let cases = [
            Case {
                name: "one pod per EFA",
                sharing: Sharing::default(),
                pods: vec![one("a", &["rdmap16s27"]), one("b", &["rdmap32s27"])],
                want: vec![],
            },
            Case {
                name: "one ID in two pods",
                sharing: Sharing::default(),
                pods: vec![
                    one("a", &["rdmap16s27", "rdmap32s27"]),
                    one("b", &["rdmap16s27"]),
                ],
                want: vec![by_kubelet("rdmap16s27", &["a", "b"])],
            },
            Case {
                name: "one EFA under its ibdev name and its PCI address, after a migration",
                sharing: Sharing::default(),
                pods: vec![one("aws", &["rdmap16s27"]), one("b", &["0000:10:1b.0"])],
                want: vec![by_kubelet("rdmap16s27", &["aws", "b"])],
            },
            Case {
                name: "without sharing: different replicas of one EFA, from an earlier count",
                sharing: Sharing::default(),
                pods: vec![one("a", &["rdmap16s27::0"]), one("b", &["rdmap16s27::1"])],
                want: vec![sharing_changed(
                    "rdmap16s27",
                    &["a", "b"],
                    &["rdmap16s27::0", "rdmap16s27::1"],
                )],
            },
            Case {
                name: "without sharing: one EFA held as a replica by one pod and whole by another",
                sharing: Sharing::default(),
                pods: vec![one("a", &["0000:10:1b.0::3"]), one("b", &["rdmap16s27"])],
                want: vec![sharing_changed(
                    "rdmap16s27",
                    &["a", "b"],
                    &["0000:10:1b.0::3"],
                )],
            },
            Case {
                name: "without sharing: one replica ID in two pods, next to another replica",
                sharing: Sharing::default(),
                pods: vec![
                    one("a", &["rdmap16s27::0"]),
                    one("b", &["rdmap16s27::0"]),
                    one("c", &["rdmap16s27::1"]),
                ],
                want: vec![by_kubelet("rdmap16s27", &["a", "b", "c"])],
            },
            Case {
                name: "three pods on one EFA",
                sharing: Sharing::default(),
                pods: vec![
                    one("c", &["rdmap16s27"]),
                    one("a", &["rdmap16s27"]),
                    one("b", &["rdmap16s27"]),
                ],
                want: vec![by_kubelet("rdmap16s27", &["a", "b", "c"])],
            },
            Case {
                name: "an ID of no EFA on this node, in two pods",
                sharing: Sharing::default(),
                pods: vec![one("a", &["0000:ff:00.0"]), one("b", &["0000:ff:00.0"])],
                want: vec![by_kubelet("0000:ff:00.0", &["a", "b"])],
            },
            Case {
                name: "sharing: different replicas of one EFA",
                sharing: shared(4),
                pods: vec![one("a", &["rdmap16s27::0"]), one("b", &["rdmap16s27::1"])],
                want: vec![],
            },
            Case {
                name: "sharing: one replica in two pods, under either name",
                sharing: shared(4),
                pods: vec![one("a", &["rdmap16s27::2"]), one("b", &["0000:10:1b.0::2"])],
                want: vec![by_kubelet("rdmap16s27::2", &["a", "b"])],
            },
            Case {
                name: "sharing: an exclusive ID from before sharing next to a replica",
                sharing: shared(4),
                pods: vec![one("old", &["rdmap16s27"]), one("b", &["rdmap16s27::0"])],
                want: vec![],
            },
            Case {
                name: "another resource's IDs",
                sharing: Sharing::default(),
                pods: vec![
                    one("a", &["rdmap16s27"]),
                    pod("ml", "gpu", "main", "nvidia.com/gpu", &["rdmap16s27"]),
                ],
                want: vec![],
            },
            Case {
                name: "one pod's containers: a restartable init container and an app container",
                sharing: Sharing::default(),
                pods: vec![pod_of(
                    "a",
                    &[("sidecar", &["rdmap16s27"]), ("main", &["rdmap16s27"])],
                )],
                want: vec![],
            },
            Case {
                name: "one pod listed twice",
                sharing: Sharing::default(),
                pods: vec![one("a", &["rdmap16s27"]), one("a", &["rdmap16s27"])],
                want: vec![],
            },
            Case {
                name: "same pod name in two namespaces",
                sharing: Sharing::default(),
                pods: vec![one("a", &["rdmap16s27"]), {
                    let mut other = one("a", &["rdmap16s27"]);
                    other.namespace = "other".into();
                    other
                }],
                want: vec![Found {
                    device: "rdmap16s27".into(),
                    pods: vec![("ml", "a"), ("other", "a")],
                    cause: Cause::Kubelet,
                }],
            },
        ];
        for case in cases {
            let response = ListPodResourcesResponse {
                pod_resources: case.pods,
            };
            assert_eq!(
                detect(&response, EFA, efa_of, case.sharing),
                case.want,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn a_booking_counts_once_two_answers_in_a_row_show_its_pods() {
        let ab = by_kubelet("rdmap16s27", &["a", "b"]);
        let mut confirmed = Confirmed::default();
        // A torn read: one answer only.
        assert!(confirmed.observe(std::slice::from_ref(&ab)).is_empty());
        assert!(confirmed.observe(&[]).is_empty());
        // A real one lasts.
        assert!(confirmed.observe(std::slice::from_ref(&ab)).is_empty());
        let first = confirmed.observe(std::slice::from_ref(&ab));
        assert_eq!(first, [booked("rdmap16s27", &["a", "b"])]);
        let again = confirmed.observe(std::slice::from_ref(&ab));
        assert_eq!(again, first);
        // The pods are kept once, not copied at every answer.
        assert!(Arc::ptr_eq(&first[0].pods[0], &again[0].pods[0]));
        // A third pod joins: it counts from the next answer on.
        let abc = by_kubelet("rdmap16s27", &["a", "b", "c"]);
        assert_eq!(
            confirmed.observe(std::slice::from_ref(&abc)),
            [booked("rdmap16s27", &["a", "b"])]
        );
        assert_eq!(
            confirmed.observe(std::slice::from_ref(&abc)),
            [booked("rdmap16s27", &["a", "b", "c"])]
        );
        // Each pod is confirmed on its own: a pod torn into one answer does not count.
        let ac = by_kubelet("rdmap16s27", &["a", "c"]);
        assert!(
            confirmed
                .observe(&[by_kubelet("rdmap16s27", &["b", "d"])])
                .is_empty()
        );
        assert!(confirmed.observe(std::slice::from_ref(&ac)).is_empty());
    }

    #[test]
    fn each_device_is_warned_of_once_while_it_lasts_and_again_when_a_pod_joins_or_it_returns() {
        let mut warned = Warned::default();
        let mut news = |confirmed: &[DoubleBooking]| -> Vec<String> {
            let warnings = warned.news(confirmed);
            assert_eq!(warnings.unnamed, 0);
            warnings
                .named
                .iter()
                .map(|booking| {
                    let pods: Vec<&str> = booking.pods.iter().map(|pod| pod.1.as_str()).collect();
                    format!("{} {}", booking.device, pods.join(","))
                })
                .collect()
        };
        let ab = booked("rdmap16s27", &["a", "b"]);
        assert_eq!(news(std::slice::from_ref(&ab)), ["rdmap16s27 a,b"]);
        assert!(news(std::slice::from_ref(&ab)).is_empty());
        assert_eq!(
            news(&[booked("rdmap16s27", &["a", "b", "c"])]),
            ["rdmap16s27 a,b,c"]
        );
        // One leaves: nothing new.
        assert!(news(&[booked("rdmap16s27", &["a", "c"])]).is_empty());
        // It ends, and comes back.
        assert!(news(&[]).is_empty());
        assert_eq!(news(std::slice::from_ref(&ab)), ["rdmap16s27 a,b"]);
    }

    /// A kubelet listing one ID in every pod: the 600 pods (a 24 KB answer) that were once
    /// warned of in 179,700 lines, and as many as the largest answer read holds.
    #[test]
    fn one_id_in_every_pod_of_an_answer_is_one_warning_naming_a_few() {
        let answer = |pods: usize| ListPodResourcesResponse {
            pod_resources: (0..pods)
                .map(|i| pod("ml", &format!("pod-{i:06}"), "main", EFA, &["rdmap16s27"]))
                .collect(),
        };
        let per_pod = prost::Message::encoded_len(&answer(1));
        for pods in [600, MAX_ANSWER / per_pod] {
            let answer = answer(pods);
            assert!(prost::Message::encoded_len(&answer) <= MAX_ANSWER);
            let (bookings, log) = poll(&answer, 3);
            assert_eq!(bookings.len(), 1);
            assert_eq!(bookings[0].pods.len(), pods);
            let warnings = log.warnings();
            assert_eq!(warnings.len(), 1, "{pods} pods: {warnings:?}");
            let named = "pods=ml/pod-000000,ml/pod-000001,ml/pod-000002,ml/pod-000003,\
                         ml/pod-000004,ml/pod-000005,ml/pod-000006,ml/pod-000007 ";
            assert!(warnings[0].contains(named), "{}", warnings[0]);
            let more = format!("more_pods={}", pods - MAX_NAMED);
            assert!(warnings[0].contains(&more), "{}", warnings[0]);
        }
    }

    #[test]
    fn devices_past_the_most_warned_of_one_by_one_are_counted_in_one_line() {
        let devices = MAX_WARNED + 5;
        let answer = ListPodResourcesResponse {
            pod_resources: (0..devices)
                .flat_map(|d| {
                    let id = format!("0000:ff:{d:02x}.0");
                    ["a", "b"].map(|p| pod("ml", &format!("{p}{d}"), "main", EFA, &[&id]))
                })
                .collect(),
        };
        let (bookings, log) = poll(&answer, 3);
        assert_eq!(bookings.len(), devices);
        let warnings = log.warnings();
        assert_eq!(warnings.len(), MAX_WARNED + 1, "{warnings:?}");
        assert!(warnings[MAX_WARNED].contains("devices=5"), "{warnings:?}");
    }

    #[test]
    fn replica_ids_held_once_sharing_is_off_are_warned_of_as_the_sharing_change() {
        let answer = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "a", "main", EFA, &["rdmap16s27::0"]),
                pod("ml", "b", "main", EFA, &["rdmap16s27::1"]),
            ],
        };
        let (bookings, log) = poll(&answer, 2);
        assert_eq!(bookings.len(), 1, "still counted: two pods use one EFA");
        let warnings = log.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        for said in [
            "an EFA is double-booked",
            "--sharing-replicas",
            "device=rdmap16s27 pods=ml/a,ml/b more_pods=0 ids=rdmap16s27::0,rdmap16s27::1",
            "drain",
        ] {
            assert!(warnings[0].contains(said), "{said} in {}", warnings[0]);
        }
        for unsaid in ["upgrade the kubelet", "137534"] {
            assert!(!warnings[0].contains(unsaid), "{unsaid} in {}", warnings[0]);
        }
    }
}
