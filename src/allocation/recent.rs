//! The IDs Allocate gave out lately, for GetPreferredAllocation to steer the next pods away from.
//!
//! Every kubelet up to 1.37 can lose track of IDs it is allocating (kubernetes PR #137534): a
//! PodResources `List` during the Allocate call rebuilds the kubelet's allocated set without
//! them, and until another pod ends it offers them to the next pod as free, while the first
//! holds them. GetPreferredAllocation ranks by topology, so without this it would prefer the very
//! IDs it just gave out, and the kubelet takes the preference. A correct kubelet offers such an
//! ID again only once its pod has gone, so steering costs it nothing but the order among free
//! ones. The window covers the pods admitted in the same burst, the case the defect needs;
//! docs/operations.md (#double-bookings) has the kubelet's code.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::sharing::{MAX_REPLICAS, SEPARATOR, Sharing};

/// What the record holds at its peak (the start-up budget, `service::budget`, counts it),
/// with every ID given out within its window: a time per ID, 16 bytes, as many as the highest
/// replica given out of each EFA (sized exactly)...
pub(crate) const PEAK_BYTES_PER_ID: usize = 16;

/// ...and per EFA, an entry naming it once: measured (glibc's `mallinfo2`, 1,780 EFAs given
/// out in random order) at 195 bytes with a 63-character name unshared, 249 with 2 replicas
/// (the replicas' times included); plus the set of EFA IDs the health monitor reads from it,
/// 105 bytes each with that name.
pub(crate) const PEAK_BYTES_PER_EFA: usize = 340;

/// How long an ID counts as given out lately. The kubelet admits a burst of pods one after
/// another, a few milliseconds each, so this covers bursts of thousands; a correct kubelet pays
/// for it only in which free IDs a pod admitted this soon after another left is preferred to get.
pub const WINDOW: Duration = Duration::from_secs(30);

/// The record's window when the kubelet's PodResources is polled every `interval`: [`WINDOW`],
/// or two polls if longer, so an ID given out stays in the record until an answer shows it
/// held: the health monitor reads it as held meanwhile.
pub fn window_for(interval: Duration) -> Duration {
    WINDOW.max(interval.saturating_mul(2))
}

/// How long an ID counts as given out just now: the pods admitted right after it, one of which
/// a kubelet that lost track of it would give it to. Under churn every ID may have been given out
/// within [`WINDOW`], but the one the kubelet lost is the latest.
pub const JUST_NOW: Duration = Duration::from_secs(5);

/// Reads an ID as every sharing count start-up accepts advertises it: `rdmap16s27::3` is
/// replica 3 of `rdmap16s27`; an ID without a replica is an EFA's own.
const ANY_SHARING: Sharing = Sharing {
    replicas: NonZeroU32::new(MAX_REPLICAS).unwrap(),
};

/// The IDs given out lately, and those of them given out just now.
#[derive(Debug, Default)]
pub struct Given {
    pub lately: BTreeSet<String>,
    pub just_now: BTreeSet<String>,
}

impl Given {
    /// Counts `id`, given out `ago`, if that is within `window`.
    fn add(&mut self, id: String, ago: Duration, window: Duration) {
        if ago > window {
            return;
        }
        if ago <= JUST_NOW {
            self.just_now.insert(id.clone());
        }
        self.lately.insert(id);
    }
}

/// When each ID was last given out, within the last `window`. One time per ID, kept by EFA: an
/// entry names its EFA once and holds a time per replica, so however many Allocates give out
/// the same IDs, the record stays within the IDs advertised (`service` budgets for it).
#[derive(Debug)]
pub struct Recent {
    window: Duration,
    given: Mutex<BTreeMap<String, Times>>,
}

/// When the IDs of one EFA were last given out.
#[derive(Debug)]
struct Times {
    /// The latest of them: the entry expires with it.
    latest: Instant,
    /// The EFA's own ID, as advertised without sharing.
    own: Option<Instant>,
    /// Replica `k`'s at index `k`, as long as the highest replica given out needs.
    replicas: Vec<Option<Instant>>,
}

impl Times {
    fn new(now: Instant) -> Self {
        Times {
            latest: now,
            own: None,
            replicas: Vec::new(),
        }
    }

    fn give(&mut self, replica: Option<u32>, now: Instant) {
        self.latest = now;
        let Some(k) = replica.map(|k| k as usize) else {
            self.own = Some(now);
            return;
        };
        if self.replicas.len() <= k {
            // Exactly as many as needed: the budget counts one time per advertised replica.
            self.replicas.reserve_exact(k + 1 - self.replicas.len());
            self.replicas.resize(k + 1, None);
        }
        self.replicas[k] = Some(now);
    }

    fn at(&self, replica: Option<u32>) -> Option<Instant> {
        match replica {
            None => self.own,
            Some(k) => self.replicas.get(k as usize).copied().flatten(),
        }
    }

    /// Each ID of `efa` the entry has a time for, with the time, spelled as [`split`] reads it.
    fn ids<'a>(&'a self, efa: &'a str) -> impl Iterator<Item = (String, Instant)> + 'a {
        let own = self.own.map(|at| (efa.to_owned(), at));
        let replicas = self
            .replicas
            .iter()
            .enumerate()
            .filter_map(move |(k, at)| at.map(|at| (format!("{efa}{SEPARATOR}{k}"), at)));
        own.into_iter().chain(replicas)
    }
}

/// The EFA an ID names, and which replica of it, if any.
fn split(id: &str) -> (&str, Option<u32>) {
    match ANY_SHARING.parse(id) {
        Some((efa, k)) => (efa, Some(k)),
        None => (id, None),
    }
}

impl Recent {
    pub fn new(window: Duration) -> Self {
        Recent {
            window,
            given: Mutex::new(BTreeMap::new()),
        }
    }

    /// Notes `ids`, which Allocate gave out, as given out now. On the Allocate path: memory
    /// only, and an ID given out again only moves its time.
    pub fn record(&self, ids: &[String]) {
        let now = Instant::now();
        let mut given = self.unexpired(now);
        for id in ids {
            let (efa, replica) = split(id);
            if let Some(times) = given.get_mut(efa) {
                times.give(replica, now);
            } else {
                let mut times = Times::new(now);
                times.give(replica, now);
                given.insert(efa.to_owned(), times);
            }
        }
    }

    /// The IDs given out within the window, and those given out within [`JUST_NOW`]: a copy of
    /// every one, where [`Recent::among`] copies only those asked about.
    pub fn ids(&self) -> Given {
        let now = Instant::now();
        let given = self.unexpired(now);
        let mut out = Given::default();
        for (efa, times) in given.iter() {
            for (id, at) in times.ids(efa) {
                out.add(id, now.duration_since(at), self.window);
            }
        }
        out
    }

    /// [`Recent::ids`] among `ids` alone: for GetPreferredAllocation, which weighs only the
    /// IDs offered, so what it copies is the size of the offer rather than of the record.
    pub fn among<'a>(&self, ids: impl IntoIterator<Item = &'a str>) -> Given {
        let now = Instant::now();
        let given = self.unexpired(now);
        let mut out = Given::default();
        for id in ids {
            let (efa, replica) = split(id);
            if let Some(at) = given.get(efa).and_then(|times| times.at(replica)) {
                out.add(id.to_owned(), now.duration_since(at), self.window);
            }
        }
        out
    }

    /// The EFAs, by the ID they were given out under, with an ID given out within `window` (at
    /// most the record's own): for the health monitor, to keep a renamed EFA's ID while the
    /// pod Allocate just gave it to may hold it before PodResources says so. One string per
    /// EFA, whatever the sharing.
    pub fn efas_given_within(&self, window: Duration) -> BTreeSet<String> {
        let now = Instant::now();
        self.unexpired(now)
            .iter()
            .filter(|(_, times)| now.duration_since(times.latest) <= window)
            .map(|(efa, _)| efa.clone())
            .collect()
    }

    /// The record, without the EFAs none of whose IDs was given out within the window.
    fn unexpired(&self, now: Instant) -> MutexGuard<'_, BTreeMap<String, Times>> {
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        given.retain(|_, times| now.duration_since(times.latest) <= self.window);
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    use crate::testkit::simulate::{Shape, inventory};

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn set(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn ids_are_remembered_for_the_window_only_and_just_now_for_less() {
        let recent = Recent::new(Duration::from_secs(10));
        assert!(recent.ids().lately.is_empty());
        recent.record(&ids(&["a", "b"]));
        assert_eq!(recent.ids().just_now, set(&["a", "b"]));
        tokio::time::advance(Duration::from_secs(6)).await;
        recent.record(&ids(&["c::1"]));
        let given = recent.ids();
        assert_eq!(given.lately, set(&["a", "b", "c::1"]));
        assert_eq!(given.just_now, set(&["c::1"]));
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(recent.ids().lately, set(&["c::1"]));
        assert_eq!(
            recent.ids().just_now,
            set(&["c::1"]),
            "5 s is still just now"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(recent.ids().lately, set(&["c::1"]));
        assert!(recent.ids().just_now.is_empty());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(recent.ids().lately.is_empty());
        assert!(
            recent.given.lock().unwrap().is_empty(),
            "expired ones are dropped"
        );
    }

    /// The times the record holds: one per replica up to the highest given out of each EFA,
    /// and one for an EFA's own ID.
    fn times_held(recent: &Recent) -> usize {
        let given = recent.given.lock().unwrap();
        given.values().map(|t| 1 + t.replicas.capacity()).sum()
    }

    /// Issue #37: the record kept every Allocate's list for the window, so a burst of Allocates
    /// of the same IDs grew it without bound (95.8 MiB after 100 of 16,384 IDs).
    #[tokio::test(start_paused = true)]
    async fn ids_given_out_again_and_again_keep_one_time_each() {
        let sharing = Sharing::replicas(NonZeroU32::new(64).unwrap());
        let all: Vec<String> = inventory(Shape::Dense256)
            .devices()
            .flat_map(|record| sharing.advertised(&record.efa.id))
            .collect();
        assert_eq!(all.len(), 16_384);
        let recent = Recent::new(WINDOW);
        // As Allocates of 64 IDs each, cycling through every ID of the node.
        for (i, allocated) in all.chunks(64).cycle().take(10_000).enumerate() {
            recent.record(allocated);
            if i % 1000 == 0 {
                tokio::time::advance(Duration::from_millis(1)).await;
            }
        }
        recent.record(&all);
        assert_eq!(recent.given.lock().unwrap().len(), 256, "one entry per EFA");
        assert_eq!(times_held(&recent), 256 + 16_384, "a time per ID");
        let given = recent.ids();
        assert_eq!(given.lately.len(), 16_384);
        assert_eq!(given.lately, all.iter().cloned().collect());
    }

    #[tokio::test(start_paused = true)]
    async fn ids_that_allocate_refuses_are_not_recorded() {
        let inventory = inventory(Shape::P4d);
        let efa = inventory.devices().next().unwrap().efa.id.clone();
        let dir = tempfile::tempdir().unwrap();
        let allocator = super::super::Allocator::new(
            Box::new(super::super::DeviceSpecs),
            super::super::contributors(
                dir.path(),
                &Default::default(),
                super::super::FoundNodes::none(),
            ),
        )
        .with_sharing(Sharing::replicas(NonZeroU32::new(4).unwrap()))
        .steering_from_recent(WINDOW);
        let recent = allocator.recent().expect("steering by the record");
        let allocate = |ids: &[String]| {
            allocator.allocate(
                &inventory,
                &AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: ids.to_vec(),
                    }],
                },
            )
        };
        let given = format!("{efa}::3");
        for refused in [
            ids(&[&given, "rdmap0s0::0"]),
            ids(&[&format!("{efa}::4")]),
            ids(&[&format!("{efa}::03")]),
            ids(&[&efa]),
        ] {
            assert!(allocate(&refused).is_err(), "{refused:?}");
        }
        assert!(recent.ids().lately.is_empty());
        assert_eq!(times_held(&recent), 0);
        allocate(&ids(&[&given])).unwrap();
        assert_eq!(recent.ids().lately, set(&[&given]));
        assert_eq!(recent.efas_given_within(WINDOW), set(&[&efa]));
    }

    #[tokio::test(start_paused = true)]
    async fn among_reads_only_the_ids_asked_about_as_ids_reads_them() {
        let recent = Recent::new(Duration::from_secs(10));
        recent.record(&ids(&["a::0", "a::2", "b", "x::01"]));
        tokio::time::advance(Duration::from_secs(6)).await;
        recent.record(&ids(&["a::1"]));
        let asked = ["a::0", "a::1", "a::3", "b", "b::0", "x::1", "x::01", "c"];
        let among = recent.among(asked);
        assert_eq!(among.lately, set(&["a::0", "a::1", "b", "x::01"]));
        assert_eq!(among.just_now, set(&["a::1"]));
        let all = recent.ids();
        assert_eq!(all.lately, set(&["a::0", "a::1", "a::2", "b", "x::01"]));
        assert_eq!(all.just_now, among.just_now);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(recent.among(asked).lately, set(&["a::1"]));
        assert_eq!(recent.ids().lately, set(&["a::1"]));
    }

    #[tokio::test(start_paused = true)]
    async fn efas_given_within_names_each_efa_once_by_the_id_it_was_given_under() {
        let recent = Recent::new(Duration::from_secs(10));
        recent.record(&ids(&["a::0", "a::63", "b"]));
        tokio::time::advance(Duration::from_secs(6)).await;
        recent.record(&ids(&["c::1", "c::2"]));
        assert_eq!(
            recent.efas_given_within(Duration::from_secs(5)),
            set(&["c"])
        );
        assert_eq!(
            recent.efas_given_within(Duration::from_secs(10)),
            set(&["a", "b", "c"])
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(
            recent.efas_given_within(Duration::from_secs(60)),
            set(&["c"]),
            "no longer than the record's own window"
        );
    }
}
