//! Devices that containers of two different pods hold at once, from the kubelet's PodResources
//! answer: what kubernetes PR #137534 (every kubelet up to 1.37) lets happen when a reservation
//! in flight is dropped, and what two allocators of one EFA do.
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
//! a real double booking does, so [`Confirmed`] reports only what two answers in a row show.

use std::collections::{BTreeMap, BTreeSet};

use crate::allocation::sharing::{self, Sharing};
use crate::proto::podresources::ListPodResourcesResponse;
use crate::state::DoubleBooking;

/// A pod, as (namespace, name).
type Pod = (String, String);

/// Every device of `resource_name` that containers of two or more pods hold in `response`,
/// sorted. `efa_of` maps a held ID (any name of an EFA, with or without a replica suffix) to the
/// EFA's advertised device id, `None` for no EFA on this node (the ID then counts as itself).
pub(crate) fn detect<'a>(
    response: &ListPodResourcesResponse,
    resource_name: &str,
    efa_of: impl Fn(&str) -> Option<&'a str>,
    sharing: Sharing,
) -> Vec<DoubleBooking> {
    // Pods borrowed from the answer: only those of a double booking are copied.
    let mut holders: BTreeMap<String, BTreeSet<(&str, &str)>> = BTreeMap::new();
    for pod in &response.pod_resources {
        let ids = pod
            .containers
            .iter()
            .flat_map(|c| &c.devices)
            .filter(|d| d.resource_name == resource_name)
            .flat_map(|d| &d.device_ids);
        for id in ids {
            let efa = efa_of(id).unwrap_or_else(|| sharing::device_of(id));
            let device = match id.rsplit_once(sharing::SEPARATOR) {
                // An unsuffixed ID under sharing was given out exclusively before sharing was on;
                // it is a foreign hold (alerted on its own), not a replica that two pods share.
                Some((_, replica)) if sharing.is_shared() => {
                    format!("{efa}{}{replica}", sharing::SEPARATOR)
                }
                _ => efa.to_owned(),
            };
            holders
                .entry(device)
                .or_default()
                .insert((&pod.namespace, &pod.name));
        }
    }
    holders
        .into_iter()
        .filter(|(_, pods)| pods.len() > 1)
        .map(|(device, pods)| DoubleBooking {
            device,
            pods: pods
                .into_iter()
                .map(|(namespace, name)| (namespace.to_owned(), name.to_owned()))
                .collect(),
        })
        .collect()
}

/// One device held by both pods of a pair, the pair sorted.
type Pair = (String, Pod, Pod);

fn pairs(bookings: &[DoubleBooking]) -> BTreeSet<Pair> {
    let mut pairs = BTreeSet::new();
    for booking in bookings {
        for (i, first) in booking.pods.iter().enumerate() {
            for second in &booking.pods[i + 1..] {
                pairs.insert((booking.device.clone(), first.clone(), second.clone()));
            }
        }
    }
    pairs
}

/// The double bookings that two answers in a row show, with one warning per device and pair of
/// pods when the pair is first confirmed, and again after it ended and came back.
#[derive(Debug, Default)]
pub(crate) struct Confirmed {
    /// The pairs the previous answer showed.
    previous: BTreeSet<Pair>,
}

impl Confirmed {
    /// Takes the bookings of one answer; returns those the previous answer showed too.
    pub(crate) fn observe(&mut self, found: &[DoubleBooking]) -> Vec<DoubleBooking> {
        let now = pairs(found);
        let confirmed: BTreeSet<&Pair> = now.intersection(&self.previous).collect();
        let mut bookings: BTreeMap<&str, BTreeSet<&Pod>> = BTreeMap::new();
        for (device, first, second) in &confirmed {
            bookings
                .entry(device.as_str())
                .or_default()
                .extend([first, second]);
        }
        let result = bookings
            .into_iter()
            .map(|(device, pods)| DoubleBooking {
                device: device.to_owned(),
                pods: pods.into_iter().cloned().collect(),
            })
            .collect();
        self.previous = now;
        result
    }
}

/// Remembers which confirmed pairs have been warned of, so each is warned of once per episode.
#[derive(Debug, Default)]
pub(crate) struct Warned(BTreeSet<Pair>);

impl Warned {
    /// The pairs of `confirmed` not warned of while they lasted; `confirmed` is then the set.
    fn new_pairs(&mut self, confirmed: &[DoubleBooking]) -> Vec<Pair> {
        let now = pairs(confirmed);
        let new = now.difference(&self.0).cloned().collect();
        self.0 = now;
        new
    }

    /// One warning per device and pair of pods of `confirmed` not warned of while it lasted.
    pub(crate) fn warn(&mut self, confirmed: &[DoubleBooking]) {
        for (device, (ns1, pod1), (ns2, pod2)) in self.new_pairs(confirmed) {
            tracing::warn!(
                %device,
                pod = %format!("{ns1}/{pod1}"),
                other_pod = %format!("{ns2}/{pod2}"),
                "an EFA is double-booked: the kubelet lists it in two running pods at once \
                 (kubernetes PR #137534, every kubelet up to 1.37); delete one of the pods and \
                 upgrade the kubelet"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::proto::podresources::{ContainerDevices, ContainerResources, PodResources};
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

    fn shared(n: u32) -> Sharing {
        Sharing::replicas(NonZeroU32::new(n).unwrap())
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

    fn booked(device: &str, pods: &[&str]) -> DoubleBooking {
        DoubleBooking {
            device: device.into(),
            pods: pods.iter().map(|p| ("ml".into(), (*p).into())).collect(),
        }
    }

    #[test]
    fn counts_pods_per_efa_or_replica() {
        struct Case {
            name: &'static str,
            sharing: Sharing,
            pods: Vec<PodResources>,
            want: Vec<DoubleBooking>,
        }
        let one = |name, ids: &'static [&'static str]| pod("ml", name, "main", EFA, ids);
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
                want: vec![booked("rdmap16s27", &["a", "b"])],
            },
            Case {
                name: "one EFA under its ibdev name and its PCI address, after a migration",
                sharing: Sharing::default(),
                pods: vec![one("aws", &["rdmap16s27"]), one("b", &["0000:10:1b.0"])],
                want: vec![booked("rdmap16s27", &["aws", "b"])],
            },
            Case {
                name: "one EFA held as a replica by one pod and whole by another",
                sharing: Sharing::default(),
                pods: vec![one("a", &["0000:10:1b.0::3"]), one("b", &["rdmap16s27"])],
                want: vec![booked("rdmap16s27", &["a", "b"])],
            },
            Case {
                name: "three pods on one EFA",
                sharing: Sharing::default(),
                pods: vec![
                    one("c", &["rdmap16s27"]),
                    one("a", &["rdmap16s27"]),
                    one("b", &["rdmap16s27"]),
                ],
                want: vec![booked("rdmap16s27", &["a", "b", "c"])],
            },
            Case {
                name: "an ID of no EFA on this node, in two pods",
                sharing: Sharing::default(),
                pods: vec![one("a", &["0000:ff:00.0"]), one("b", &["0000:ff:00.0"])],
                want: vec![booked("0000:ff:00.0", &["a", "b"])],
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
                want: vec![booked("rdmap16s27::2", &["a", "b"])],
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
                name: "same pod name in two namespaces",
                sharing: Sharing::default(),
                pods: vec![one("a", &["rdmap16s27"]), {
                    let mut other = one("a", &["rdmap16s27"]);
                    other.namespace = "other".into();
                    other
                }],
                want: vec![DoubleBooking {
                    device: "rdmap16s27".into(),
                    pods: vec![("ml".into(), "a".into()), ("other".into(), "a".into())],
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
    fn a_booking_counts_once_two_answers_in_a_row_show_it() {
        let ab = booked("rdmap16s27", &["a", "b"]);
        let mut confirmed = Confirmed::default();
        // A torn read: one answer only.
        assert!(confirmed.observe(std::slice::from_ref(&ab)).is_empty());
        assert!(confirmed.observe(&[]).is_empty());
        // A real one lasts.
        assert!(confirmed.observe(std::slice::from_ref(&ab)).is_empty());
        assert_eq!(
            confirmed.observe(std::slice::from_ref(&ab)),
            vec![ab.clone()]
        );
        assert_eq!(
            confirmed.observe(std::slice::from_ref(&ab)),
            vec![ab.clone()]
        );
        // A third pod joins: the pair with it counts from the next answer on.
        let abc = booked("rdmap16s27", &["a", "b", "c"]);
        assert_eq!(confirmed.observe(std::slice::from_ref(&abc)), [ab]);
        assert_eq!(confirmed.observe(std::slice::from_ref(&abc)), [abc]);
    }

    #[test]
    fn each_pair_is_warned_of_once_while_it_lasts_and_again_after() {
        let ab = booked("rdmap16s27", &["a", "b"]);
        let abc = booked("rdmap16s27", &["a", "b", "c"]);
        let names = |pairs: Vec<Pair>| -> Vec<String> {
            pairs
                .into_iter()
                .map(|(device, (_, p1), (_, p2))| format!("{device} {p1} {p2}"))
                .collect()
        };
        let mut warned = Warned::default();
        assert_eq!(
            names(warned.new_pairs(std::slice::from_ref(&ab))),
            ["rdmap16s27 a b"]
        );
        assert!(warned.new_pairs(std::slice::from_ref(&ab)).is_empty());
        assert_eq!(
            names(warned.new_pairs(std::slice::from_ref(&abc))),
            ["rdmap16s27 a c", "rdmap16s27 b c"]
        );
        assert!(warned.new_pairs(&[]).is_empty());
        assert_eq!(
            names(warned.new_pairs(std::slice::from_ref(&ab))),
            ["rdmap16s27 a b"]
        );
    }
}
