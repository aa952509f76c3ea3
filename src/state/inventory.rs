//! The device model and its fold: every EFA ever seen, with the health monitor's verdict
//! ([`Inventory`]), the observation a pass folds into it, and the snapshot's two writers
//! ([`DeviceState`] for the health monitor, [`ConflictWriter`] for the DRA-conflict guard).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use super::snapshot::{Reader, Writer};
use crate::discovery::Efa;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Health {
    Healthy,
    Unhealthy,
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Health::Healthy => "Healthy",
            Health::Unhealthy => "Unhealthy",
        })
    }
}

/// What kind of failure makes a device Unhealthy: a closed set, so a metric labelled with it
/// has a bounded number of series, where the reason's text names paths and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// Its uverbs node is missing, cannot be read, or is not the character device sysfs names.
    DeviceNode,
    /// Its sysfs entry could not be read, fully or in time.
    Unreadable,
    /// It left sysfs or its driver.
    Vanished,
    /// An EFA DRA driver is registered on the node, so every device is withheld.
    DraConflict,
    /// The driver closed its admin queue: see `health::admin_queue`.
    AdminQueueClosed,
}

impl Failure {
    /// Every cause, in label order.
    pub const ALL: [Failure; 5] = [
        Failure::AdminQueueClosed,
        Failure::DeviceNode,
        Failure::DraConflict,
        Failure::Unreadable,
        Failure::Vanished,
    ];

    /// The label value metrics and `list --output json` show.
    pub fn label(self) -> &'static str {
        match self {
            Failure::DeviceNode => "device_node",
            Failure::Unreadable => "unreadable",
            Failure::Vanished => "vanished",
            Failure::DraConflict => "dra_conflict",
            Failure::AdminQueueClosed => "admin_queue_closed",
        }
    }
}

/// A device's health and, when unhealthy, its cause and why in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub health: Health,
    pub cause: Option<Failure>,
    pub reason: Option<String>,
}

impl Verdict {
    pub fn healthy() -> Self {
        Verdict {
            health: Health::Healthy,
            cause: None,
            reason: None,
        }
    }

    pub fn unhealthy(cause: Failure, reason: impl Into<String>) -> Self {
        Verdict {
            health: Health::Unhealthy,
            cause: Some(cause),
            reason: Some(reason.into()),
        }
    }
}

/// A device the plugin has seen at least once, with the attributes it last had.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRecord {
    pub efa: Efa,
    pub verdict: Verdict,
}

impl DeviceRecord {
    pub fn is_healthy(&self) -> bool {
        self.verdict.health == Health::Healthy
    }
}

/// Every device ever seen, keyed by the ID it is advertised under. A device is one PCI
/// function: its ID may change (an ibdev rename), its PCI address does not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    /// What the kubelet is told: `observed`, overridden by `conflict`.
    devices: BTreeMap<String, DeviceRecord>,
    /// The health monitor's own verdicts, kept so a device's health returns when a conflict ends.
    observed: BTreeMap<String, DeviceRecord>,
    /// Why nothing may be allocated on this node right now (another driver owns the EFAs).
    conflict: Option<Conflict>,
    /// The RDMA subsystem hides the EFAs from every network namespace but the host's.
    netns_exclusive: bool,
    /// PCI address -> the ID an earlier run of the plugin advertised it under, for a device this
    /// run has not seen yet: a renamed EFA whose old ID a pod may hold keeps it across restarts.
    remembered: BTreeMap<String, String>,
}

/// A DRA driver registered on the node that allocates the same EFAs, and why that withholds
/// every device: the driver for the gauge's label, the reason for the kubelet and `list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub driver: String,
    pub reason: String,
}

impl Conflict {
    /// `record` as served while the conflict lasts: Unhealthy for the conflict's reason,
    /// whatever its own verdict. The one rule, for the snapshot and for `list`.
    pub(crate) fn withhold(&self, record: &DeviceRecord) -> DeviceRecord {
        DeviceRecord {
            efa: record.efa.clone(),
            verdict: Verdict::unhealthy(Failure::DraConflict, self.reason.clone()),
        }
    }
}

/// What a new observation changed, for logging each change once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Added(DeviceRecord),
    Health {
        before: Verdict,
        after: DeviceRecord,
    },
    /// The PCI function got another ibdev name; `after` is listed under the ID it now has,
    /// which is still `before`'s while a pod holds that.
    Renamed {
        before: Efa,
        after: DeviceRecord,
    },
}

/// Why a device that is no longer in the scan is still listed.
const VANISHED: &str = "no longer in sysfs or no longer bound to the efa driver";

impl Inventory {
    pub fn devices(&self) -> impl ExactSizeIterator<Item = &DeviceRecord> {
        self.devices.values()
    }

    pub fn get(&self, id: &str) -> Option<&DeviceRecord> {
        self.devices.get(id)
    }

    /// The device each of its names stands for: its ID, its ibdev name and its PCI address,
    /// whichever a pod was given it under. An ID wins over another device's ibdev name (a
    /// renamed EFA keeps a held ID that sysfs may by now give another EFA): IDs are what the
    /// kubelet hands out.
    pub fn by_name(&self) -> BTreeMap<&str, &DeviceRecord> {
        let mut names = BTreeMap::new();
        for record in self.devices() {
            names.insert(record.efa.ibdev.as_str(), record);
            names.insert(record.efa.pci_address.as_str(), record);
        }
        for record in self.devices() {
            names.insert(record.efa.id.as_str(), record);
        }
        names
    }

    pub fn healthy_count(&self) -> usize {
        self.devices().filter(|d| d.is_healthy()).count()
    }

    pub fn conflict(&self) -> Option<&str> {
        self.conflict.as_ref().map(|c| c.reason.as_str())
    }

    /// The DRA driver the conflict is with, if there is one.
    pub fn conflicting_driver(&self) -> Option<&str> {
        self.conflict.as_ref().map(|c| c.driver.as_str())
    }

    pub fn netns_exclusive(&self) -> bool {
        self.netns_exclusive
    }

    /// Rebuilds what is advertised; a conflict hides every device's own verdict without
    /// losing it.
    fn with(observed: BTreeMap<String, DeviceRecord>, conflict: Option<Conflict>) -> Inventory {
        let devices = match &conflict {
            None => observed.clone(),
            Some(conflict) => observed
                .iter()
                .map(|(id, record)| (id.clone(), conflict.withhold(record)))
                .collect(),
        };
        Inventory {
            devices,
            observed,
            conflict,
            netns_exclusive: false,
            remembered: BTreeMap::new(),
        }
    }

    /// Folds in one complete observation of every device.
    pub fn observe(&self, observed: Vec<DeviceRecord>) -> (Inventory, Vec<Change>) {
        self.fold(Observation::complete(observed))
    }

    /// Folds one observation in. Observed devices take the observed verdict and attributes; a
    /// known device missing from the observation stays listed as Unhealthy, so the kubelet keeps
    /// it in capacity and a pod holding it is not silently orphaned: with the reason its entry
    /// could not be read, if that is why, or as vanished. A pass that did not reach a device
    /// leaves it as it was.
    ///
    /// A device is matched by its PCI address, so a renamed EFA is one device under a new name,
    /// not one vanishing and another appearing. The kubelet keeps an ID that a pod holds
    /// allocated whether or not it is still listed, and counts a listed one it has not handed
    /// out as free: advertising the new name beside a held old one would give the EFA to a
    /// second pod, and dropping the held one would leave its holder's checkpoint naming an ID
    /// that no longer exists. So a held old name stays the device's ID, until no pod holds it
    /// (`observation.held`); a name no pod holds makes way at once.
    pub fn fold(&self, observation: Observation) -> (Inventory, Vec<Change>) {
        let Observation {
            records: observed,
            unreadable,
            complete,
            held,
        } = observation;
        let by_pci: BTreeMap<&str, &DeviceRecord> = self
            .observed
            .values()
            .map(|record| (record.efa.pci_address.as_str(), record))
            .collect();
        let named = name_devices(observed, &by_pci, &self.remembered, &held);
        let mut next = BTreeMap::new();
        let mut changes = Vec::new();
        let mut seen_pci = std::collections::BTreeSet::new();
        for record in named {
            let known = by_pci.get(record.efa.pci_address.as_str()).copied();
            seen_pci.insert(record.efa.pci_address.clone());
            match known {
                None => changes.push(Change::Added(record.clone())),
                Some(old) if old.efa.id != record.efa.id || old.efa.ibdev != record.efa.ibdev => {
                    changes.push(Change::Renamed {
                        before: old.efa.clone(),
                        after: record.clone(),
                    })
                }
                Some(old) if old.verdict.health != record.verdict.health => {
                    changes.push(Change::Health {
                        before: old.verdict.clone(),
                        after: record.clone(),
                    })
                }
                Some(_) => {}
            }
            next.insert(record.efa.id.clone(), record);
        }
        for (id, old) in &self.observed {
            // Found under a name of its own, or its ID now names another device.
            if seen_pci.contains(&old.efa.pci_address) || next.contains_key(id) {
                continue;
            }
            let verdict = match unreadable.get(&old.efa.ibdev) {
                Some(reason) => Verdict::unhealthy(Failure::Unreadable, reason.clone()),
                None if !complete => old.verdict.clone(),
                None => Verdict::unhealthy(Failure::Vanished, VANISHED),
            };
            let gone = DeviceRecord {
                efa: old.efa.clone(),
                verdict,
            };
            if old.verdict.health != gone.verdict.health {
                changes.push(Change::Health {
                    before: old.verdict.clone(),
                    after: gone.clone(),
                });
            }
            next.insert(id.clone(), gone);
        }
        let next = Inventory {
            netns_exclusive: self.netns_exclusive,
            remembered: self.remembered.clone(),
            ..Inventory::with(next, self.conflict.clone())
        };
        (next, changes)
    }
}

/// The ID each observed device is listed under, one device per ID. A renamed device whose old ID
/// a pod holds keeps it; every other device takes the name the scan found, unless a device kept
/// that name, then its own earlier ID, then its PCI address (an ID no ibdev name collides with,
/// as names with `:` are not made by the kernel): a device whose name moved keeps being served.
/// A device's earlier ID is the one this run listed it under, or else the one an earlier run
/// did (`remembered`).
fn name_devices(
    observed: Vec<DeviceRecord>,
    by_pci: &BTreeMap<&str, &DeviceRecord>,
    remembered: &BTreeMap<String, String>,
    held: &Held,
) -> Vec<DeviceRecord> {
    let earlier = |record: &DeviceRecord| {
        let pci = record.efa.pci_address.as_str();
        by_pci
            .get(pci)
            .map(|old| old.efa.id.clone())
            .or_else(|| remembered.get(pci).cloned())
    };
    let kept = |record: &DeviceRecord| {
        earlier(record).filter(|old| *old != record.efa.id && held.holds(old))
    };
    let mut taken: std::collections::BTreeSet<String> = observed.iter().filter_map(kept).collect();
    let mut named = Vec::with_capacity(observed.len());
    for mut record in observed {
        let id = match kept(&record) {
            Some(old) => Some(old),
            None => [
                Some(record.efa.id.clone()),
                earlier(&record),
                Some(record.efa.pci_address.clone()),
            ]
            .into_iter()
            .flatten()
            .find(|id| taken.insert(id.clone())),
        };
        // Only a device whose name, earlier ID and PCI address are all taken is left out: two
        // records of one PCI function, which discovery never gives (it keeps one entry each).
        if let Some(id) = id {
            record.efa.id = id;
            named.push(record);
        }
    }
    named
}

/// Which advertised IDs pods hold, as the kubelet's PodResources view last said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Held {
    /// The view is not known: any ID may be held.
    #[default]
    Unknown,
    Ids(std::collections::BTreeSet<String>),
}

impl Held {
    fn holds(&self, id: &str) -> bool {
        match self {
            Held::Unknown => true,
            Held::Ids(ids) => ids.contains(id),
        }
    }
}

/// What one pass of the health monitor saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    pub records: Vec<DeviceRecord>,
    /// ibdev -> why its entry could not be read in this pass.
    pub unreadable: BTreeMap<String, String>,
    /// Whether the pass got through every entry; devices it did not reach keep their verdict.
    pub complete: bool,
    /// Which IDs pods hold: a renamed device keeps a held ID.
    pub held: Held,
}

impl Observation {
    pub fn complete(records: Vec<DeviceRecord>) -> Self {
        Observation {
            records,
            unreadable: BTreeMap::new(),
            complete: true,
            held: Held::Unknown,
        }
    }
}

/// Read-only access to the device snapshot, for the kubelet service, telemetry and the files
/// that mirror the devices.
pub type DeviceReader = Reader<Arc<Inventory>>;

/// The health monitor's writer of the device snapshot: what it observes, and the RDMA
/// subsystem's mode. The DRA-conflict guard writes the rest through the [`ConflictWriter`] made
/// with it; everyone else gets a [`DeviceReader`].
pub struct DeviceState {
    writer: Writer<Arc<Inventory>>,
}

/// The DRA-conflict guard's writer of the device snapshot: whether another driver owns the
/// devices. Made only together with the snapshot's [`DeviceState`].
pub struct ConflictWriter {
    writer: Writer<Arc<Inventory>>,
}

impl DeviceState {
    /// A new, empty snapshot and its two writers, one per writing module.
    pub fn with_conflict_writer() -> (DeviceState, ConflictWriter) {
        let writer = Writer::<Arc<Inventory>>::default();
        let conflict = ConflictWriter {
            writer: writer.second(),
        };
        (DeviceState { writer }, conflict)
    }

    /// A new, empty snapshot whose conflict writer is dropped: no DRA-conflict guard can
    /// withhold its devices. For the tests and tools that run no guard.
    #[cfg(any(test, feature = "testkit"))]
    pub fn unguarded() -> DeviceState {
        DeviceState::with_conflict_writer().0
    }

    pub fn reader(&self) -> DeviceReader {
        self.writer.reader()
    }

    pub fn current(&self) -> Arc<Inventory> {
        self.writer.borrow().clone()
    }

    /// Applies a complete observation; readers are woken only when something actually changed.
    pub fn apply(&self, observed: Vec<DeviceRecord>) -> Vec<Change> {
        self.apply_observation(Observation::complete(observed))
    }

    /// Applies an observation, complete or not; readers are woken only on real change.
    pub fn apply_observation(&self, observation: Observation) -> Vec<Change> {
        let mut changes = Vec::new();
        self.writer.send_if_modified(|current| {
            let (next, found) = current.fold(observation);
            changes = found;
            if next == **current {
                return false;
            }
            *current = Arc::new(next);
            true
        });
        changes
    }

    /// Takes the IDs an earlier run advertised, by PCI address, for the devices this run has not
    /// listed yet: a held one stays a renamed device's ID, as a rename seen while running does.
    pub fn remember(&self, by_pci: BTreeMap<String, String>) {
        self.writer.send_modify(|current| {
            *current = Arc::new(Inventory {
                remembered: by_pci,
                ..(**current).clone()
            });
        });
    }

    /// Records the RDMA subsystem's network-namespace mode; returns whether that changed.
    pub fn set_netns_exclusive(&self, exclusive: bool) -> bool {
        self.writer.send_if_modified(|current| {
            if current.netns_exclusive == exclusive {
                return false;
            }
            *current = Arc::new(Inventory {
                netns_exclusive: exclusive,
                ..(**current).clone()
            });
            true
        })
    }
}

impl ConflictWriter {
    pub fn current(&self) -> Arc<Inventory> {
        self.writer.borrow().clone()
    }

    /// Sets or clears the reason every device is withheld from allocation; returns whether
    /// that changed.
    pub fn set_conflict(&self, conflict: Option<Conflict>) -> bool {
        self.writer.send_if_modified(|current| {
            if current.conflict == conflict {
                return false;
            }
            *current = Arc::new(Inventory {
                netns_exclusive: current.netns_exclusive,
                ..Inventory::with(current.observed.clone(), conflict)
            });
            true
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::state) fn conflict(reason: &str) -> Option<Conflict> {
        Some(Conflict {
            driver: "dra.net".into(),
            reason: reason.into(),
        })
    }
    use crate::discovery::DevNum;

    pub(in crate::state) fn record(id: &str, verdict: Verdict) -> DeviceRecord {
        DeviceRecord {
            efa: Efa {
                id: id.into(),
                pci_address: id.into(),
                ibdev: format!("ib-{id}"),
                uverbs: "uverbs0".into(),
                dev: DevNum {
                    major: 231,
                    minor: 192,
                },
                numa_node: Some(0),
                pci_path: id.into(),
                vendor: "0x1d0f".into(),
                device: "0xefa1".into(),
            },
            verdict,
        }
    }

    fn health(state: &DeviceState) -> Vec<(String, Health)> {
        state
            .current()
            .devices()
            .map(|d| (d.efa.id.clone(), d.verdict.health))
            .collect()
    }

    #[test]
    fn a_conflict_withholds_every_device_and_its_end_restores_each_verdict() {
        let (state, guard) = DeviceState::with_conflict_writer();
        state.apply(vec![
            record("a", Verdict::healthy()),
            record("b", Verdict::unhealthy(Failure::DeviceNode, "node missing")),
        ]);
        assert!(guard.set_conflict(conflict("dra.net owns the EFAs")));
        let inventory = state.current();
        assert_eq!(inventory.healthy_count(), 0);
        assert_eq!(inventory.devices().len(), 2, "capacity stays visible");
        assert_eq!(inventory.conflict(), Some("dra.net owns the EFAs"));
        assert_eq!(
            inventory.get("a").and_then(|d| d.verdict.reason.as_deref()),
            Some("dra.net owns the EFAs")
        );
        assert!(!guard.set_conflict(conflict("dra.net owns the EFAs")));

        assert!(guard.set_conflict(None));
        assert_eq!(
            health(&state),
            [
                ("a".to_owned(), Health::Healthy),
                ("b".to_owned(), Health::Unhealthy)
            ]
        );
    }

    #[test]
    fn observations_during_a_conflict_report_the_devices_own_changes() {
        let (state, guard) = DeviceState::with_conflict_writer();
        state.apply(vec![record("a", Verdict::healthy())]);
        guard.set_conflict(conflict("conflict"));
        // The device's own health did not change, so there is nothing to log.
        assert!(
            state
                .apply(vec![record("a", Verdict::healthy())])
                .is_empty()
        );
        let changes = state.apply(vec![record(
            "a",
            Verdict::unhealthy(Failure::DeviceNode, "gone"),
        )]);
        assert!(matches!(changes.as_slice(), [Change::Health { .. }]));
        assert_eq!(state.current().healthy_count(), 0);
        guard.set_conflict(None);
        assert_eq!(health(&state), [("a".to_owned(), Health::Unhealthy)]);
    }

    #[test]
    fn a_vanished_device_stays_unhealthy_and_recovers() {
        let state = DeviceState::unguarded();
        let changes = state.apply(vec![
            record("a", Verdict::healthy()),
            record("b", Verdict::healthy()),
        ]);
        assert_eq!(changes.len(), 2);
        assert!(matches!(changes[0], Change::Added(_)));

        let changes = state.apply(vec![record("a", Verdict::healthy())]);
        assert_eq!(changes.len(), 1);
        let current = state.current();
        let b = current.get("b").unwrap();
        assert_eq!(b.verdict, Verdict::unhealthy(Failure::Vanished, VANISHED));
        assert_eq!(current.healthy_count(), 1);
        assert_eq!(current.devices().len(), 2);

        // Still gone: no new change to log.
        assert!(
            state
                .apply(vec![record("a", Verdict::healthy())])
                .is_empty()
        );

        let changes = state.apply(vec![
            record("a", Verdict::healthy()),
            record("b", Verdict::healthy()),
        ]);
        assert!(matches!(&changes[..], [Change::Health { after, .. }] if after.is_healthy()));
        assert_eq!(state.current().healthy_count(), 2);
    }

    #[test]
    fn an_unreadable_device_is_unhealthy_with_its_reason_and_an_unreached_one_keeps_its_verdict() {
        let state = DeviceState::unguarded();
        state.apply(vec![
            record("a", Verdict::healthy()),
            record("b", Verdict::healthy()),
            record("c", Verdict::healthy()),
        ]);
        let changes = state.apply_observation(Observation {
            records: vec![record("a", Verdict::healthy())],
            unreadable: BTreeMap::from([("ib-b".to_owned(), "dev: a FIFO".to_owned())]),
            complete: false,
            held: Held::Unknown,
        });
        assert_eq!(changes.len(), 1);
        let current = state.current();
        assert_eq!(
            current.get("b").unwrap().verdict,
            Verdict::unhealthy(Failure::Unreadable, "dev: a FIFO")
        );
        assert!(
            current.get("c").unwrap().is_healthy(),
            "not reached, not changed"
        );
        state.apply_observation(Observation {
            records: vec![record("a", Verdict::healthy())],
            unreadable: BTreeMap::new(),
            complete: true,
            held: Held::Unknown,
        });
        assert_eq!(
            state.current().get("c").unwrap().verdict,
            Verdict::unhealthy(Failure::Vanished, VANISHED)
        );
    }

    /// A device at PCI address `pci` named `name`, under ibdev IDs.
    fn named(pci: &str, name: &str) -> DeviceRecord {
        let mut device = record(name, Verdict::healthy());
        device.efa.pci_address = pci.into();
        device.efa.ibdev = name.into();
        device
    }

    fn ids(inventory: &Inventory) -> Vec<(&str, &str)> {
        inventory
            .devices()
            .map(|d| (d.efa.id.as_str(), d.efa.pci_address.as_str()))
            .collect()
    }

    fn held_ids(ids: &[&str]) -> Held {
        Held::Ids(ids.iter().map(|id| (*id).to_owned()).collect())
    }

    #[test]
    fn a_device_is_its_pci_function_whatever_its_name() {
        let (start, _) =
            Inventory::default().observe(vec![named("p1", "efa_0"), named("p2", "efa_1")]);
        let observe = |held: Held| {
            start.fold(Observation {
                held,
                ..Observation::complete(vec![named("p1", "rdmap16s27"), named("p2", "efa_1")])
            })
        };
        let (next, changes) = observe(held_ids(&[]));
        assert_eq!(ids(&next), [("efa_1", "p2"), ("rdmap16s27", "p1")]);
        let [Change::Renamed { before, after }] = changes.as_slice() else {
            panic!("{changes:?}");
        };
        assert_eq!(
            (before.id.as_str(), after.efa.id.as_str()),
            ("efa_0", "rdmap16s27")
        );
        for held in [held_ids(&["efa_0"]), Held::Unknown] {
            let (next, _) = observe(held);
            assert_eq!(ids(&next), [("efa_0", "p1"), ("efa_1", "p2")]);
            assert_eq!(next.get("efa_0").unwrap().efa.ibdev, "rdmap16s27");
        }
    }

    #[test]
    fn a_name_kept_for_its_holder_is_never_given_to_a_second_device() {
        // Two EFAs swap names while a pod holds `efa_0`.
        let (start, _) =
            Inventory::default().observe(vec![named("p1", "efa_0"), named("p2", "efa_1")]);
        let swapped = vec![named("p1", "efa_1"), named("p2", "efa_0")];
        let (next, _) = start.fold(Observation {
            held: held_ids(&["efa_0"]),
            ..Observation::complete(swapped.clone())
        });
        assert_eq!(ids(&next), [("efa_0", "p1"), ("efa_1", "p2")]);
        let names = next.by_name();
        assert_eq!(
            names["efa_0"].efa.pci_address, "p1",
            "an ID wins over an ibdev name"
        );
        assert_eq!(names["efa_1"].efa.pci_address, "p2");
        // A new EFA named as a held, kept name: listed under its PCI address.
        let (next, _) = next.fold(Observation {
            held: held_ids(&["efa_0"]),
            ..Observation::complete(vec![named("p1", "efa_1"), named("p3", "efa_0")])
        });
        assert_eq!(next.devices().len(), 3, "{:?}", ids(&next));
        assert_eq!(next.get("efa_0").unwrap().efa.pci_address, "p1");
        assert_eq!(next.get("p3").unwrap().efa.ibdev, "efa_0");
        // Released: every device under the name it has.
        let (next, _) = start.fold(Observation {
            held: held_ids(&[]),
            ..Observation::complete(swapped)
        });
        assert_eq!(ids(&next), [("efa_0", "p2"), ("efa_1", "p1")]);
    }

    #[test]
    fn readers_wake_only_on_real_changes() {
        let state = DeviceState::unguarded();
        let mut reader = state.reader().subscribe();
        state.apply(vec![record("a", Verdict::healthy())]);
        assert!(reader.has_changed().unwrap());
        reader.borrow_and_update();
        state.apply(vec![record("a", Verdict::healthy())]);
        assert!(!reader.has_changed().unwrap());
        state.apply(vec![record(
            "a",
            Verdict::unhealthy(Failure::DeviceNode, "node missing"),
        )]);
        assert!(reader.has_changed().unwrap());
    }
}
