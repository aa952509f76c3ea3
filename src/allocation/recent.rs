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

use std::collections::{BTreeSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// How long an ID counts as given out lately. The kubelet admits a burst of pods one after
/// another, a few milliseconds each, so this covers bursts of thousands; a correct kubelet pays
/// for it only in which free IDs a pod admitted this soon after another left is preferred to get.
pub const WINDOW: Duration = Duration::from_secs(30);

/// How long an ID counts as given out just now: the pods admitted right after it, one of which
/// a kubelet that lost track of it would give it to. Under churn every ID may have been given out
/// within [`WINDOW`], but the one the kubelet lost is the latest.
pub const JUST_NOW: Duration = Duration::from_secs(5);

/// The IDs given out lately, and those of them given out just now.
#[derive(Debug, Default)]
pub struct Given {
    pub lately: BTreeSet<String>,
    pub just_now: BTreeSet<String>,
}

/// IDs given out within the last `window`, oldest first.
#[derive(Debug)]
pub struct Recent {
    window: Duration,
    given: Mutex<VecDeque<(Instant, Vec<String>)>>,
}

impl Recent {
    pub fn new(window: Duration) -> Self {
        Recent {
            window,
            given: Mutex::new(VecDeque::new()),
        }
    }

    /// Notes `ids` as given out now. On the Allocate path: memory only, and what it keeps is
    /// bounded by the allocations of one window.
    pub fn record(&self, ids: &[String]) {
        let now = Instant::now();
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut given, now);
        given.push_back((now, ids.to_vec()));
    }

    /// The IDs given out within the window, and those given out within [`JUST_NOW`].
    pub fn ids(&self) -> Given {
        let now = Instant::now();
        let mut given = self.given.lock().unwrap_or_else(|e| e.into_inner());
        self.expire(&mut given, now);
        let mut out = Given::default();
        for (at, ids) in given.iter() {
            if now.duration_since(*at) <= JUST_NOW {
                out.just_now.extend(ids.iter().cloned());
            }
            out.lately.extend(ids.iter().cloned());
        }
        out
    }

    fn expire(&self, given: &mut VecDeque<(Instant, Vec<String>)>, now: Instant) {
        while given
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > self.window)
        {
            given.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
