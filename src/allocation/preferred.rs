//! GetPreferredAllocation: which of the IDs the kubelet offers a container should get.
//!
//! The choice minimises, in this order:
//! 0. EFAs that a pod holds under a foreign ID (one this plugin does not advertise, say the AWS
//!    plugin's): the kubelet counts them as free, so they are chosen only when nothing else can
//!    satisfy the request;
//! 1. IDs this plugin's Allocate gave out just now, then 2. those it gave out lately
//!    ([`super::recent`]): a correct kubelet offers one again only once its pod has gone, but a
//!    kubelet up to 1.37 can lose track of one (kubernetes PR #137534) and offer it to the next
//!    pod while the first still holds it. The one it lost is the latest it gave out, while under
//!    churn every ID may have been given out lately;
//! 3. replicas of an EFA already chosen: with sharing on, a second ID of the same EFA opens the
//!    same uverbs node and adds no bandwidth, so distinct EFAs come first;
//! 4. NUMA nodes;
//! 5. distinct PCIe bridges at each depth of the device's sysfs path, outermost first: the root
//!    complex `pci0000:10`, then its root port, then a switch's upstream port, and so on. Paths
//!    that share a longer prefix sit closer on the fabric.
//!
//! Remaining ties go to the devices first in topology order (NUMA node, then PCI path, which
//! puts lower addresses first), and the answer does not depend on the order of the offer.
//!
//! The levels nest (a bridge lies in one NUMA node, a device below one bridge), so the exact
//! optimum is a knapsack over that tree: every subtree keeps the cheapest cost vector for each
//! count it could contribute, and siblings merge pairwise, O(devices × request) in all. The
//! kubelet calls this before every allocation and waits without a deadline, so it works on the
//! snapshot in memory and never fails: IDs it does not know are left to the kubelet.

use std::collections::{BTreeMap, BTreeSet};

use crate::allocation::sharing::Sharing;
use crate::proto::deviceplugin::{
    ContainerPreferredAllocationRequest, ContainerPreferredAllocationResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::state::Inventory;

/// Bridge levels that count; deeper ones are rare and lie below all of these anyway.
const MAX_BRIDGES: usize = 8;
/// Cost slots: foreign-held EFAs, IDs given out just now, IDs given out lately, extra replicas,
/// NUMA nodes, then one per bridge level.
const LEVELS: usize = MAX_BRIDGES + 5;
const FOREIGN_HELD: usize = 0;
const JUST_NOW: usize = 1;
const JUST_GIVEN: usize = 2;
const EXTRA_REPLICAS: usize = 3;
/// The slot of the NUMA level; bridge level `i` is the slot `NUMA + i`.
const NUMA: usize = 4;

/// What a choice steers away from before it weighs topology.
#[derive(Clone, Copy, Debug)]
pub struct Avoid<'a> {
    /// EFAs (by advertised device id) that pods hold under foreign IDs.
    pub foreign_held: &'a BTreeSet<String>,
    /// IDs (as advertised, replicas included) that Allocate gave out lately.
    pub just_given: &'a BTreeSet<String>,
    /// Those of `just_given` that it gave out just now.
    pub just_now: &'a BTreeSet<String>,
}

impl Avoid<'_> {
    pub const NOTHING: Avoid<'static> = Avoid {
        foreign_held: &BTreeSet::new(),
        just_given: &BTreeSet::new(),
        just_now: &BTreeSet::new(),
    };
}

/// How many of each kind of thing a choice spans, most important first; compared as a whole.
type Cost = [u32; LEVELS];

/// Answers every container of a request.
pub(crate) fn respond(
    inventory: &Inventory,
    sharing: Sharing,
    avoid: Avoid,
    request: &PreferredAllocationRequest,
) -> PreferredAllocationResponse {
    PreferredAllocationResponse {
        container_responses: request
            .container_requests
            .iter()
            .map(|container| ContainerPreferredAllocationResponse {
                device_i_ds: choose(inventory, sharing, avoid, container),
            })
            .collect(),
    }
}

/// The preferred IDs for one container, sorted: `allocation_size` of them when the offer holds
/// that many usable ones, always including every offered must-include ID this plugin knows
/// (even past the size: the kubelet gives those to the container regardless).
pub fn choose(
    inventory: &Inventory,
    sharing: Sharing,
    avoid: Avoid,
    request: &ContainerPreferredAllocationRequest,
) -> Vec<String> {
    let size = usize::try_from(request.allocation_size).unwrap_or(0);
    let candidates = candidates(inventory, sharing, avoid, request);
    let total: usize = candidates.iter().map(|c| c.replicas.len()).sum();
    let forced: usize = candidates.iter().map(Candidate::forced).sum();
    let want = size.min(total);
    let mut chosen = Vec::with_capacity(want.max(forced));
    if forced >= want || want == total {
        // Nothing to weigh: all of the forced IDs, or all of the offer.
        for candidate in &candidates {
            let take = if forced >= want {
                candidate.forced()
            } else {
                candidate.replicas.len()
            };
            chosen.extend(candidate.take(take));
        }
    } else {
        let tree = Node::build(&candidates, depth_of(&candidates), want);
        tree.collect(want, &candidates, &mut chosen);
    }
    chosen.sort_unstable();
    chosen.into_iter().map(str::to_owned).collect()
}

/// One offered ID of an EFA.
struct Replica<'a> {
    id: &'a str,
    number: u32,
    forced: bool,
    given: Recency,
}

/// How lately Allocate gave an ID out; later is worse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Recency {
    NotLately,
    Lately,
    JustNow,
}

/// An EFA with at least one usable offered ID, and where it sits.
struct Candidate<'a> {
    device: &'a str,
    /// The PCI address, so ties go to lower addresses whatever the ID strategy.
    address: &'a str,
    /// A pod holds it under a foreign ID.
    foreign_held: bool,
    numa: Option<u32>,
    /// The bridges above the PCI function, outermost first.
    bridges: Vec<&'a str>,
    /// Forced ones first, then those given out least lately, then by replica number: the order
    /// in which they are handed out.
    replicas: Vec<Replica<'a>>,
}

/// Which group a candidate falls in at one depth of the tree.
#[derive(PartialEq, Eq)]
enum Group<'a> {
    Numa(Option<u32>),
    Bridge(&'a str),
    /// Past the end of a short path the device is a group of its own.
    Alone(&'a str),
}

impl<'a> Candidate<'a> {
    fn group(&self, depth: usize) -> Group<'a> {
        match depth {
            0 => Group::Numa(self.numa),
            d => self
                .bridges
                .get(d - 1)
                .map_or(Group::Alone(self.device), |bridge| Group::Bridge(bridge)),
        }
    }

    fn forced(&self) -> usize {
        self.replicas.iter().filter(|r| r.forced).count()
    }

    /// How many of the first `count` replicas were given out at least as lately as `given`.
    fn given(&self, count: usize, given: Recency) -> u32 {
        self.replicas
            .iter()
            .take(count)
            .filter(|r| r.given >= given)
            .count() as u32
    }

    fn take(&self, count: usize) -> impl Iterator<Item = &'a str> + '_ {
        self.replicas.iter().take(count).map(|r| r.id)
    }
}

/// The offered IDs this plugin can serve, grouped by EFA and sorted in topology order. An
/// unhealthy EFA is left out unless an ID of it must be included: Allocate would refuse it.
fn candidates<'a>(
    inventory: &'a Inventory,
    sharing: Sharing,
    avoid: Avoid,
    request: &'a ContainerPreferredAllocationRequest,
) -> Vec<Candidate<'a>> {
    let must: BTreeSet<&str> = request
        .must_include_device_i_ds
        .iter()
        .map(String::as_str)
        .collect();
    let mut by_device: BTreeMap<&str, Candidate> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for id in &request.available_device_i_ds {
        if !seen.insert(id.as_str()) {
            continue;
        }
        let Some((device, number)) = sharing.parse(id) else {
            continue;
        };
        let Some(record) = inventory.get(device) else {
            continue;
        };
        let forced = must.contains(id.as_str());
        if !forced && !record.is_healthy() {
            continue;
        }
        let efa = &record.efa;
        by_device
            .entry(efa.id.as_str())
            .or_insert_with(|| {
                let mut bridges: Vec<&str> = efa.pci_path.split('/').collect();
                bridges.pop();
                bridges.truncate(MAX_BRIDGES);
                Candidate {
                    device: &efa.id,
                    address: &efa.pci_address,
                    foreign_held: avoid.foreign_held.contains(&efa.id),
                    numa: efa.numa_node,
                    bridges,
                    replicas: Vec::new(),
                }
            })
            .replicas
            .push(Replica {
                id,
                number,
                forced,
                given: if avoid.just_now.contains(id) {
                    Recency::JustNow
                } else if avoid.just_given.contains(id) {
                    Recency::Lately
                } else {
                    Recency::NotLately
                },
            });
    }
    let mut all: Vec<Candidate> = by_device.into_values().collect();
    for candidate in &mut all {
        candidate
            .replicas
            .sort_unstable_by_key(|r| (!r.forced, r.given, r.number));
    }
    all.sort_unstable_by(|a, b| {
        (a.numa, &a.bridges, a.address, a.device).cmp(&(b.numa, &b.bridges, b.address, b.device))
    });
    all
}

/// The deepest group level: NUMA is level 0, bridge `i` is level `i + 1`.
fn depth_of(candidates: &[Candidate]) -> usize {
    candidates
        .iter()
        .map(|c| c.bridges.len())
        .max()
        .unwrap_or(0)
}

/// A subtree of the topology and what it can contribute.
struct Node {
    /// `best[c]`: the cheapest way to take `c` IDs below this node; `None` when `c` is too few
    /// for the must-include IDs below it.
    best: Vec<Option<Cost>>,
    below: Below,
}

enum Below {
    /// Index into the candidates.
    Device(usize),
    Parts {
        parts: Vec<Node>,
        /// `splits[i][c]`: how many of `c` IDs taken from parts `0..=i` come from part `i`.
        splits: Vec<Vec<u32>>,
    },
}

impl Node {
    /// The whole topology of the offer; `want` bounds every table.
    fn build(candidates: &[Candidate], max_depth: usize, want: usize) -> Node {
        Self::subtree(candidates, 0, 0, max_depth, want)
    }

    /// The node holding `candidates[..]` (which sit at `offset` of the whole list and share
    /// their groups above `depth`), with each of their groups at `depth` as a part.
    fn subtree(
        candidates: &[Candidate],
        offset: usize,
        depth: usize,
        max_depth: usize,
        want: usize,
    ) -> Node {
        let mut parts = Vec::new();
        if depth > max_depth {
            for (i, candidate) in candidates.iter().enumerate() {
                parts.push(Node::device(candidate, offset + i, want));
            }
        } else {
            let mut start = 0;
            while start < candidates.len() {
                let group = candidates[start].group(depth);
                let end = start
                    + candidates[start..]
                        .iter()
                        .position(|c| c.group(depth) != group)
                        .unwrap_or(candidates.len() - start);
                let mut part = Self::subtree(
                    &candidates[start..end],
                    offset + start,
                    depth + 1,
                    max_depth,
                    want,
                );
                // Using the group at all costs one at its level.
                for cost in part.best.iter_mut().skip(1).flatten() {
                    cost[NUMA + depth] += 1;
                }
                parts.push(part);
                start = end;
            }
        }
        // A lone part needs no merge: its table already is this node's. Chains of single
        // bridges are the common case (root port above one switch above one device).
        if parts.len() == 1 {
            return parts.remove(0);
        }
        Node::merge(parts, want)
    }

    fn device(candidate: &Candidate, index: usize, want: usize) -> Node {
        let forced = candidate.forced();
        let best = (0..=candidate.replicas.len().min(want))
            .map(|count| {
                (count >= forced).then(|| {
                    let mut cost = Cost::default();
                    cost[FOREIGN_HELD] = u32::from(candidate.foreign_held && count > 0);
                    cost[JUST_NOW] = candidate.given(count, Recency::JustNow);
                    cost[JUST_GIVEN] = candidate.given(count, Recency::Lately);
                    cost[EXTRA_REPLICAS] = count.saturating_sub(1) as u32;
                    cost
                })
            })
            .collect();
        Node {
            best,
            below: Below::Device(index),
        }
    }

    /// Knapsack over the parts in order; on equal cost the earlier part takes more, which is
    /// what makes lower addresses win ties.
    fn merge(parts: Vec<Node>, want: usize) -> Node {
        let mut acc: Vec<Option<Cost>> = vec![Some(Cost::default())];
        let mut splits = Vec::with_capacity(parts.len());
        for part in &parts {
            let len = (acc.len() + part.best.len() - 1).min(want + 1);
            let mut next: Vec<Option<Cost>> = vec![None; len];
            let mut split = vec![0u32; len];
            for (a, left) in acc.iter().enumerate().rev() {
                let Some(left) = left else { continue };
                for (b, right) in part.best.iter().enumerate().take(len - a) {
                    let Some(right) = right else { continue };
                    let cost = add(left, right);
                    if next[a + b].is_none_or(|best| cost < best) {
                        next[a + b] = Some(cost);
                        split[a + b] = b as u32;
                    }
                }
            }
            acc = next;
            splits.push(split);
        }
        Node {
            best: acc,
            below: Below::Parts { parts, splits },
        }
    }

    /// Walks the choices that gave `best[count]`.
    fn collect<'a>(&self, count: usize, candidates: &[Candidate<'a>], out: &mut Vec<&'a str>) {
        match &self.below {
            Below::Device(index) => out.extend(candidates[*index].take(count)),
            Below::Parts { parts, splits } => {
                let mut left = count;
                for (part, split) in parts.iter().zip(splits).rev() {
                    let here = split[left] as usize;
                    part.collect(here, candidates, out);
                    left -= here;
                }
            }
        }
    }
}

fn add(a: &Cost, b: &Cost) -> Cost {
    std::array::from_fn(|i| a[i] + b[i])
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::allocation::sharing::shared;
    use crate::discovery::DeviceIdStrategy;
    use crate::discovery::Efa;
    use crate::state::{DeviceRecord, Failure, Verdict};
    use crate::testkit::simulate::{self, Shape};

    /// PCI IDs, so each expected answer shows where its EFAs sit; the property tests below
    /// also run under the default strategy.
    fn inventory(shape: Shape) -> Inventory {
        simulate::inventory_named(shape, DeviceIdStrategy::Pci)
    }

    fn advertised(inventory: &Inventory, sharing: Sharing) -> Vec<String> {
        inventory
            .devices()
            .flat_map(|r| sharing.advertised(&r.efa.id))
            .collect()
    }

    fn ask(
        inventory: &Inventory,
        sharing: Sharing,
        available: &[String],
        must: &[String],
        size: i32,
    ) -> Vec<String> {
        ask_avoiding(inventory, sharing, Avoid::NOTHING, available, must, size)
    }

    fn ask_avoiding(
        inventory: &Inventory,
        sharing: Sharing,
        avoid: Avoid,
        available: &[String],
        must: &[String],
        size: i32,
    ) -> Vec<String> {
        choose(
            inventory,
            sharing,
            avoid,
            &ContainerPreferredAllocationRequest {
                available_device_i_ds: available.to_vec(),
                must_include_device_i_ds: must.to_vec(),
                allocation_size: size,
            },
        )
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn efa<'a>(inventory: &'a Inventory, sharing: Sharing, id: &str) -> &'a Efa {
        &inventory.get(sharing.parse(id).unwrap().0).unwrap().efa
    }

    /// The objective computed directly from the chosen IDs: foreign-held EFAs, IDs given out
    /// just now, IDs given out lately, extra replicas, NUMA nodes, then distinct path prefixes at each bridge depth.
    fn cost(
        inventory: &Inventory,
        sharing: Sharing,
        avoid: Avoid,
        chosen: &[String],
    ) -> Vec<usize> {
        let devices: BTreeMap<&str, &Efa> = chosen
            .iter()
            .map(|id| efa(inventory, sharing, id))
            .map(|efa| (efa.id.as_str(), efa))
            .collect();
        let held = devices
            .keys()
            .filter(|id| avoid.foreign_held.contains(**id))
            .count();
        let given = |set: &BTreeSet<String>| chosen.iter().filter(|id| set.contains(*id)).count();
        let mut cost = vec![
            held,
            given(avoid.just_now),
            given(avoid.just_given),
            chosen.len() - devices.len(),
        ];
        let numa: BTreeSet<Option<u32>> = devices.values().map(|e| e.numa_node).collect();
        cost.push(numa.len());
        for depth in 1..=MAX_BRIDGES {
            let groups: BTreeSet<String> = devices
                .values()
                .map(|e| {
                    let parts: Vec<&str> = e.pci_path.split('/').collect();
                    let bridges = &parts[..parts.len() - 1];
                    if depth <= bridges.len() {
                        bridges[..depth].join("/")
                    } else {
                        e.id.clone()
                    }
                })
                .collect();
            cost.push(groups.len());
        }
        cost
    }

    /// The oracle: the cheapest [`cost`] of any `want` of the offered IDs that holds every
    /// must-include one, found by trying every such subset.
    fn best_cost(
        inventory: &Inventory,
        sharing: Sharing,
        avoid: Avoid,
        available: &[String],
        must: &[String],
        want: usize,
    ) -> Option<Vec<usize>> {
        let n = available.len();
        if want > n {
            return None;
        }
        let mut pick: Vec<usize> = (0..want).collect();
        let mut best: Option<Vec<usize>> = None;
        loop {
            let chosen: Vec<String> = pick.iter().map(|&i| available[i].clone()).collect();
            if must.iter().all(|id| chosen.contains(id)) {
                let c = cost(inventory, sharing, avoid, &chosen);
                if best.as_ref().is_none_or(|b| c < *b) {
                    best = Some(c);
                }
            }
            // The next subset in lexicographic order: bump the last index that can move.
            let Some(i) = (0..want).rev().find(|&i| pick[i] < n - want + i) else {
                return best;
            };
            pick[i] += 1;
            for j in i + 1..want {
                pick[j] = pick[j - 1] + 1;
            }
        }
    }

    /// n choose k, or something far above any test's budget once it outgrows a u64.
    fn subsets(n: u64, k: u64) -> u64 {
        (0..k.min(n - k)).fold(1, |acc: u64, i| acc.saturating_mul(n - i) / (i + 1))
    }

    /// The PCIe root complexes the (unshared) IDs sit below.
    fn roots(inventory: &Inventory, chosen: &[String]) -> BTreeSet<String> {
        chosen
            .iter()
            .map(|id| efa(inventory, Sharing::default(), id).pci_path.as_str())
            .map(|path| path.split('/').next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn p4d_pairs_stay_on_one_numa_node() {
        let inv = inventory(Shape::P4d);
        let all = advertised(&inv, Sharing::default());
        assert_eq!(
            ask(&inv, Sharing::default(), &all, &[], 2),
            ["0000:10:1b.0", "0000:20:1b.0"]
        );
        assert_eq!(
            ask(&inv, Sharing::default(), &all, &ids(&["0000:a0:1b.0"]), 2),
            ["0000:90:1b.0", "0000:a0:1b.0"]
        );
        assert_eq!(
            ask(&inv, Sharing::default(), &all, &[], 3),
            ["0000:10:1b.0", "0000:20:1b.0", "0000:90:1b.0"]
        );
    }

    #[test]
    fn p5_fills_a_whole_switch_before_opening_another() {
        let inv = inventory(Shape::P5);
        let all = advertised(&inv, Sharing::default());
        let four = ask(&inv, Sharing::default(), &all, &[], 4);
        assert_eq!(
            four,
            [
                "0000:4f:00.0",
                "0000:50:00.0",
                "0000:51:00.0",
                "0000:52:00.0"
            ]
        );
        // With one EFA of the first switch taken, four still come from a single switch.
        let rest: Vec<String> = all
            .iter()
            .filter(|id| *id != "0000:50:00.0")
            .cloned()
            .collect();
        let four = ask(&inv, Sharing::default(), &rest, &[], 4);
        let roots = roots(&inv, &four);
        assert_eq!(roots.len(), 1, "{four:?}");
        assert!(!four.contains(&"0000:50:00.0".to_owned()));
    }

    #[test]
    fn p5_must_include_pulls_the_rest_next_to_it() {
        let inv = inventory(Shape::P5);
        let all = advertised(&inv, Sharing::default());
        let must = ids(&["0000:a5:00.0"]);
        let six = ask(&inv, Sharing::default(), &all, &must, 6);
        assert_eq!(six.len(), 6);
        assert!(six.contains(&must[0]));
        // The must-include EFA's whole switch (buses 0xa4-0xa7, below root 0xa1), then two from
        // one other switch on NUMA 1.
        let roots = roots(&inv, &six);
        assert_eq!(roots.len(), 2, "{six:?}");
        assert!(roots.contains("pci0000:a1"), "{six:?}");
        for id in &six {
            assert_eq!(efa(&inv, Sharing::default(), id).numa_node, Some(1));
        }
    }

    /// Too large for brute force, but the optimum is known: a full node packs `k` EFAs into
    /// ceil(k / per NUMA node) NUMA nodes and ceil(k / per root) roots.
    #[test]
    fn full_nodes_pack_every_size_tightly() {
        for (shape, per_numa, per_root) in [
            (Shape::P5, 16, 4),
            (Shape::P5en, 8, 2),
            (Shape::P6B300, 8, 2),
            (Shape::Trn2, 8, 2),
            (Shape::Trn3, 8, 2),
            (Shape::G7, 1, 1),
            (Shape::Dense256, 128, 16),
        ] {
            let inv = inventory(shape);
            let all = advertised(&inv, Sharing::default());
            for k in 1..=all.len() {
                let answer = ask(&inv, Sharing::default(), &all, &[], k as i32);
                let numa: BTreeSet<Option<u32>> = answer
                    .iter()
                    .map(|id| efa(&inv, Sharing::default(), id).numa_node)
                    .collect();
                assert_eq!(numa.len(), k.div_ceil(per_numa), "{shape:?} k={k}");
                assert_eq!(
                    roots(&inv, &answer).len(),
                    k.div_ceil(per_root),
                    "{shape:?} k={k}"
                );
            }
        }
    }

    #[test]
    fn trainium_fills_switch_pairs_on_one_numa_node_and_g5_takes_its_one() {
        for shape in [Shape::Trn2, Shape::Trn3] {
            let inv = inventory(shape);
            let all = advertised(&inv, Sharing::default());
            // Two switches of two, not four from anywhere: NUMA first, then switches.
            let four = ask(&inv, Sharing::default(), &all, &[], 4);
            assert_eq!(roots(&inv, &four).len(), 2, "{shape:?}: {four:?}");
            let numa: BTreeSet<Option<u32>> = four
                .iter()
                .map(|id| efa(&inv, Sharing::default(), id).numa_node)
                .collect();
            assert_eq!(numa.len(), 1, "{shape:?}: {four:?}");
        }
        // trn2's NUMA node 0 holds buses 0x56-0x6d and 0xb3-0xca (Neuron devices 0-7).
        let trn2 = inventory(Shape::Trn2);
        let all = advertised(&trn2, Sharing::default());
        assert_eq!(
            ask(&trn2, Sharing::default(), &all, &[], 4),
            [
                "0000:56:00.0",
                "0000:57:00.0",
                "0000:6c:00.0",
                "0000:6d:00.0"
            ]
        );

        let g5 = inventory(Shape::G5);
        let all = advertised(&g5, Sharing::default());
        assert_eq!(ask(&g5, Sharing::default(), &all, &[], 1), all);
    }

    /// Every shape against the brute-force oracle, for each request size whose subsets are few
    /// enough to try, with and without a must-include ID.
    #[test]
    fn every_shape_answers_as_locally_as_the_best_choice() {
        const MAX_SUBSETS: u64 = 5_000;
        let none = Sharing::default();
        for shape in Shape::ALL {
            let inv = inventory(shape);
            let all = advertised(&inv, none);
            let musts: Vec<Vec<String>> = match all.last() {
                Some(last) => vec![Vec::new(), vec![last.clone()]],
                None => vec![Vec::new()],
            };
            for must in &musts {
                for k in 1..=all.len() {
                    if subsets(all.len() as u64, k as u64) > MAX_SUBSETS {
                        continue;
                    }
                    let answer = ask(&inv, none, &all, must, k as i32);
                    assert_eq!(
                        Some(cost(&inv, none, Avoid::NOTHING, &answer)),
                        best_cost(&inv, none, Avoid::NOTHING, &all, must, k),
                        "{shape:?} k={k} must={must:?}: {answer:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn whatever_the_kubelet_sends_gets_an_answer() {
        let inv = inventory(Shape::P4d);
        let none = Sharing::default();
        let all = advertised(&inv, none);
        assert!(ask(&inv, none, &[], &[], 2).is_empty());
        assert!(ask(&inv, none, &all, &[], 0).is_empty());
        assert!(ask(&inv, none, &all, &[], -3).is_empty());
        assert_eq!(ask(&inv, none, &all, &[], 9), all);
        let noisy = ids(&[
            "0000:90:1b.0",
            "0000:90:1b.0",
            "0000:ff:00.0",
            "",
            "0000:10:1b.0::0",
        ]);
        assert_eq!(
            ask(&inv, none, &noisy, &ids(&["0000:ff:00.0"]), 2),
            ["0000:90:1b.0"]
        );
        // Must-include IDs that were not offered are not ours to add.
        assert_eq!(
            ask(&inv, none, &all[..1], &ids(&["0000:a0:1b.0"]), 1),
            ["0000:10:1b.0"]
        );
        // More must-include IDs than the size: the kubelet allocates them anyway.
        assert_eq!(ask(&inv, none, &all, &all[1..3], 1), all[1..3]);
    }

    #[test]
    fn efas_held_under_foreign_ids_are_chosen_last() {
        let inv = inventory(Shape::P4d);
        let all = advertised(&inv, Sharing::default());
        // A pod from before a migration holds both NUMA-0 EFAs under the AWS plugin's IDs.
        let held: BTreeSet<String> = ids(&["0000:10:1b.0", "0000:20:1b.0"]).into_iter().collect();
        let avoid = Avoid {
            foreign_held: &held,
            ..Avoid::NOTHING
        };
        let avoiding = |size| ask_avoiding(&inv, Sharing::default(), avoid, &all, &[], size);
        assert_eq!(avoiding(2), ["0000:90:1b.0", "0000:a0:1b.0"]);
        assert_eq!(avoiding(1), ["0000:90:1b.0"]);
        // Past the free ones, as few held EFAs as the request needs.
        let three = avoiding(3);
        assert_eq!(
            three.iter().filter(|id| held.contains(*id)).count(),
            1,
            "{three:?}"
        );
        // What the kubelet requires is still given.
        let must = ids(&["0000:10:1b.0"]);
        let forced = ask_avoiding(&inv, Sharing::default(), avoid, &all, &must, 2);
        assert!(forced.contains(&must[0]), "{forced:?}");
    }

    #[test]
    fn ids_given_out_lately_are_chosen_after_free_ones_and_foreign_held_ones_last() {
        let inv = inventory(Shape::P4d);
        let all = advertised(&inv, Sharing::default());
        let given: BTreeSet<String> = ids(&["0000:10:1b.0", "0000:20:1b.0"]).into_iter().collect();
        let held: BTreeSet<String> = ids(&["0000:90:1b.0"]).into_iter().collect();
        let avoid = Avoid {
            foreign_held: &held,
            just_given: &given,
            ..Avoid::NOTHING
        };
        let asking =
            |size, must: &[String]| ask_avoiding(&inv, Sharing::default(), avoid, &all, must, size);
        assert_eq!(asking(1, &[]), ["0000:a0:1b.0"]);
        // Past the free one, an ID given out lately before an EFA held under a foreign ID.
        assert_eq!(asking(2, &[]), ["0000:10:1b.0", "0000:a0:1b.0"]);
        assert_eq!(asking(4, &[]), all);
        let must = ids(&["0000:20:1b.0"]);
        assert_eq!(asking(2, &must), ["0000:20:1b.0", "0000:a0:1b.0"]);

        // Under sharing, by replica: another replica of the same EFA is not avoided.
        let sharing = shared(2);
        let all = advertised(&inv, sharing);
        let given: BTreeSet<String> = ids(&["0000:10:1b.0::0"]).into_iter().collect();
        let avoid = Avoid {
            just_given: &given,
            ..Avoid::NOTHING
        };
        assert_eq!(
            ask_avoiding(&inv, sharing, avoid, &all, &[], 1),
            ["0000:10:1b.0::1"]
        );
        assert_eq!(
            ask_avoiding(&inv, sharing, avoid, &all, &[], 2),
            ["0000:10:1b.0::1", "0000:20:1b.0::0"]
        );
    }

    #[test]
    fn under_churn_the_id_given_out_just_now_is_chosen_last() {
        // Every EFA was given out lately, as in a burst of short pods; the kubelet offers the
        // two free ones and, having lost track of it, the one it gave out a moment ago.
        let inv = inventory(Shape::P4d);
        let all = advertised(&inv, Sharing::default());
        let given: BTreeSet<String> = all.iter().cloned().collect();
        let now: BTreeSet<String> = ids(&["0000:10:1b.0"]).into_iter().collect();
        let nothing = BTreeSet::new();
        let offer = ids(&["0000:10:1b.0", "0000:20:1b.0", "0000:a0:1b.0"]);
        let asking = |just_now: &BTreeSet<String>, size| {
            let avoid = Avoid {
                just_given: &given,
                just_now,
                ..Avoid::NOTHING
            };
            ask_avoiding(&inv, Sharing::default(), avoid, &offer, &[], size)
        };
        // By topology alone the NUMA-0 pair, or the first of it.
        assert_eq!(asking(&nothing, 1), ["0000:10:1b.0"]);
        assert_eq!(asking(&now, 1), ["0000:20:1b.0"]);
        // Even at the price of a second NUMA node.
        assert_eq!(asking(&now, 2), ["0000:20:1b.0", "0000:a0:1b.0"]);
        assert_eq!(asking(&now, 3), offer);
    }

    #[test]
    fn unhealthy_efas_are_left_out_unless_required() {
        let mut records: Vec<DeviceRecord> = inventory(Shape::P4d).devices().cloned().collect();
        records[0].verdict = Verdict::unhealthy(Failure::DeviceNode, "node missing");
        let inv = Inventory::default().observe(records).0;
        let all = advertised(&inv, Sharing::default());
        assert_eq!(
            ask(&inv, Sharing::default(), &all, &[], 1),
            ["0000:20:1b.0"]
        );
        assert_eq!(
            ask(&inv, Sharing::default(), &all, &all[..1], 2),
            ["0000:10:1b.0", "0000:20:1b.0"]
        );
    }

    #[test]
    fn replicas_spread_over_distinct_efas_first() {
        let inv = inventory(Shape::P4d);
        let sharing = shared(2);
        let all = advertised(&inv, sharing);
        assert_eq!(
            ask(&inv, sharing, &all, &[], 2),
            ["0000:10:1b.0::0", "0000:20:1b.0::0"]
        );
        let five = ask(&inv, sharing, &all, &[], 5);
        let distinct: BTreeSet<&str> = five.iter().map(|id| sharing.parse(id).unwrap().0).collect();
        assert_eq!(distinct.len(), 4, "{five:?}");
        // A replica someone else holds is simply not offered; the other one still serves.
        let offered: Vec<String> = all
            .iter()
            .filter(|id| *id != "0000:10:1b.0::0")
            .cloned()
            .collect();
        assert_eq!(ask(&inv, sharing, &offered, &[], 1), ["0000:10:1b.0::1"]);
    }

    /// A layout, a sharing setting, and an offer drawn from its advertised IDs.
    fn offer(
        max_offered: usize,
    ) -> impl Strategy<Value = (Inventory, u32, Vec<String>, Vec<String>, i32)> {
        let ids = proptest::sample::select(vec![DeviceIdStrategy::Ibdev, DeviceIdStrategy::Pci]);
        (proptest::sample::select(Shape::ALL.to_vec()), ids, 1u32..=3).prop_flat_map(
            move |(shape, ids, n)| {
                let inventory = simulate::inventory_named(shape, ids);
                let all = advertised(&inventory, shared(n));
                let count = all.len();
                proptest::sample::subsequence(all, 0..=count.min(max_offered)).prop_flat_map(
                    move |available| {
                        let len = available.len();
                        (
                            Just(inventory.clone()),
                            Just(n),
                            Just(available.clone()),
                            proptest::sample::subsequence(available, 0..=len.min(3)),
                            -1i32..=(len as i32 + 2),
                        )
                    },
                )
            },
        )
    }

    proptest! {
        #[test]
        fn answers_keep_the_contract(
            (inv, n, available, must, size) in offer(usize::MAX),
            foreign in proptest::collection::vec("[0-9a-f:.]{0,14}", 0..3),
            shuffle in any::<proptest::sample::Index>(),
        ) {
            let sharing = shared(n);
            let mut offered = available.clone();
            offered.extend(foreign.iter().cloned());
            let answer = ask(&inv, sharing, &offered, &must, size);

            let offered_set: BTreeSet<&String> = available.iter().collect();
            let answer_set: BTreeSet<&String> = answer.iter().collect();
            prop_assert_eq!(answer_set.len(), answer.len(), "duplicates in {:?}", answer);
            prop_assert!(answer_set.is_subset(&offered_set), "{:?} not from the offer", answer);
            for id in &must {
                prop_assert!(answer_set.contains(id), "{} missing from {:?}", id, answer);
            }
            let expected = (size.max(0) as usize).min(available.len()).max(must.len());
            prop_assert_eq!(answer.len(), expected);

            // Neither the order of the offer nor repeated IDs change the answer.
            let mut reordered = offered.clone();
            let turn = shuffle.index(reordered.len().max(1));
            reordered.rotate_left(turn);
            reordered.extend(available.iter().take(2).cloned());
            let again = ask(&inv, sharing, &reordered, &must, size);
            prop_assert_eq!(&again, &answer);
        }

        #[test]
        fn answers_are_as_local_as_the_best_choice(
            (inv, n, available, must, size) in offer(9),
            held in proptest::collection::vec(any::<proptest::sample::Index>(), 0..3),
            given in proptest::collection::vec(any::<proptest::sample::Index>(), 0..4),
            now in 0usize..3,
        ) {
            let sharing = shared(n);
            let ids: Vec<&String> = inv.devices().map(|r| &r.efa.id).collect();
            let foreign_held: BTreeSet<String> = held
                .iter()
                .filter(|_| !ids.is_empty())
                .map(|i| ids[i.index(ids.len())].clone())
                .collect();
            let just_given: BTreeSet<String> = given
                .iter()
                .filter(|_| !available.is_empty())
                .map(|i| available[i.index(available.len())].clone())
                .collect();
            // Given out just now: the latest few of those given out lately.
            let just_now: BTreeSet<String> = just_given.iter().take(now).cloned().collect();
            let avoid = Avoid { foreign_held: &foreign_held, just_given: &just_given, just_now: &just_now };
            let answer = ask_avoiding(&inv, sharing, avoid, &available, &must, size);
            let best = best_cost(&inv, sharing, avoid, &available, &must, answer.len());
            prop_assert_eq!(Some(cost(&inv, sharing, avoid, &answer)), best);
        }
    }
}
