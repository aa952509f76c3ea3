//! The PodResources view's types: who holds which EFA, as the kubelet last said
//! ([`Holdings`], written by `crate::holdings` alone).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::inventory::{Held, Inventory};

/// A container that holds a device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// Device id → the containers holding it, sorted, each named once: a container holding many
/// IDs shares one [`Holder`] among them, so the view grows with the IDs held, not with their
/// holders' names (up to 379 bytes each) times the IDs.
pub type Holders = BTreeMap<String, Vec<Arc<Holder>>>;

/// IDs a container holds under this plugin's resource name that this plugin does not advertise:
/// given out by the AWS plugin, or by this one under another ID strategy or sharing count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignHold {
    pub holder: Arc<Holder>,
    /// Sorted, each once.
    pub ids: Vec<String>,
}

/// One device that containers of two or more pods hold at once: the kubelet gave one ID out
/// twice (kubernetes PR #137534), two allocators gave out one EFA, or its replica IDs outlived
/// a change of the sharing count.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DoubleBooking {
    /// The EFA's advertised device id; under sharing, with the replica suffix held.
    pub device: String,
    /// The pods holding it, as (namespace, name), sorted; at least two. Shared with the
    /// detector's record of the answers, so a booking that lasts is not copied at each poll.
    pub pods: Vec<Arc<(String, String)>>,
    pub cause: Cause,
}

/// How the pods of a [`DoubleBooking`] came to hold one device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// The kubelet gave the device to two pods: one ID, or the EFA under its two names.
    Kubelet,
    /// Without sharing, the pods hold different IDs of the EFA, replica IDs among them, which
    /// the plugin gave out while it shared the EFA under another count: the kubelet counts each
    /// ID as a device of its own. It lasts as long as those pods.
    SharingChanged {
        /// The replica IDs held, sorted: the first few.
        ids: Vec<String>,
        /// How many replica IDs are held in all.
        held: usize,
    },
}

/// Who holds which EFA, as the kubelet's PodResources API last said. Written by the background
/// poller alone, so nothing on the Allocate path waits on the kubelet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holdings {
    /// Whether this is what the kubelet said: its last answer, or one kept over failed polls
    /// for a bounded time ([`crate::holdings::STALE_LIMIT`]). Not known: the kubelet has not
    /// answered yet, or not for longer than that; the holders are then the last known ones
    /// (none if it never answered), and any ID may be held.
    pub known: bool,
    /// Whether the kubelet failed to answer since its last good answer, which the view is.
    pub stale: bool,
    /// Advertised device id → the containers holding it, under its own ID or a foreign one.
    pub holders: Holders,
    pub foreign: Vec<ForeignHold>,
    /// The advertised device ids that foreign IDs map to: the kubelet counts them as free.
    pub foreign_devices: BTreeSet<String>,
    /// The devices held by two or more pods in consecutive answers, sorted.
    pub double_booked: Vec<DoubleBooking>,
}

impl Holdings {
    /// What the health monitor may read of the view: the IDs held, or unknown.
    pub fn held(&self) -> Held {
        if self.known {
            Held::Ids(self.holders.keys().cloned().collect())
        } else {
            Held::Unknown
        }
    }

    /// How many foreign IDs are held.
    pub fn foreign_ids(&self) -> usize {
        self.foreign.iter().map(|f| f.ids.len()).sum()
    }

    /// The EFAs pods hold through this plugin while `inventory` is withheld for a DRA driver:
    /// the driver cannot see them, so it may hand them to a second pod. None without a conflict.
    pub fn unseen_by_dra(&self, inventory: &Inventory) -> usize {
        match inventory.conflict() {
            Some(_) => self.holders.len(),
            None => 0,
        }
    }

    /// Each pod holding EFAs through this plugin during a DRA conflict, with the device ids it
    /// holds; empty without a conflict.
    pub fn pods_unseen_by_dra(
        &self,
        inventory: &Inventory,
    ) -> BTreeMap<(String, String), Vec<String>> {
        let mut pods: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        if inventory.conflict().is_none() {
            return pods;
        }
        for (device, holders) in &self.holders {
            for holder in holders {
                let ids = pods
                    .entry((holder.namespace.clone(), holder.pod.clone()))
                    .or_default();
                // A pod's containers may share a device.
                if !ids.contains(device) {
                    ids.push(device.clone());
                }
            }
        }
        pods
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::inventory::tests::{conflict, record};
    use crate::state::{DeviceState, Verdict};

    fn held(pairs: &[(&str, &str, &str)]) -> Holdings {
        let mut holders = Holders::new();
        for (device, pod, container) in pairs {
            holders
                .entry((*device).into())
                .or_default()
                .push(Arc::new(Holder {
                    namespace: "ml".into(),
                    pod: (*pod).into(),
                    container: (*container).into(),
                }));
        }
        Holdings {
            known: true,
            holders,
            ..Holdings::default()
        }
    }

    #[test]
    fn held_efas_count_as_unseen_by_dra_only_during_a_conflict() {
        let (state, guard) = DeviceState::with_conflict_writer();
        state.apply(vec![
            record("a", Verdict::healthy()),
            record("b", Verdict::healthy()),
            record("c", Verdict::healthy()),
        ]);
        // Two containers of one pod share a; another pod holds b.
        let holdings = held(&[
            ("a", "p1", "main"),
            ("a", "p1", "side"),
            ("b", "p2", "main"),
        ]);
        assert_eq!(holdings.unseen_by_dra(&state.current()), 0);
        assert!(holdings.pods_unseen_by_dra(&state.current()).is_empty());

        guard.set_conflict(conflict("dra.net"));
        assert_eq!(holdings.unseen_by_dra(&state.current()), 2);
        let pods = holdings.pods_unseen_by_dra(&state.current());
        assert_eq!(
            pods.into_iter().collect::<Vec<_>>(),
            [
                (("ml".into(), "p1".into()), vec!["a".to_owned()]),
                (("ml".into(), "p2".into()), vec!["b".to_owned()]),
            ]
        );
        assert_eq!(Holdings::default().unseen_by_dra(&state.current()), 0);

        guard.set_conflict(None);
        assert_eq!(holdings.unseen_by_dra(&state.current()), 0);
    }
}
