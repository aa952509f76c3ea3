//! Allocate and GetPreferredAllocation requests as the kubelet (or anyone reaching the socket)
//! could send them, against a simulated node: IDs the node advertises, mangled ones and
//! arbitrary strings, any sizes. Answers must be consistent, never a panic.

#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::path::Path;

use arbitrary::Arbitrary;
use efa_device_plugin::allocation::sharing::Sharing;
use efa_device_plugin::allocation::{self, Allocator, DeviceSpecs};
use efa_device_plugin::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest,
};
use efa_device_plugin::state::{DeviceRecord, Failure, Inventory, Verdict};
use efa_device_plugin::testkit::simulate::{self, Shape};
use libfuzzer_sys::fuzz_target;

const SHAPES: &[Shape] = &[Shape::P4d, Shape::P5, Shape::G5, Shape::Dense256];

#[derive(Arbitrary, Debug)]
enum Id {
    /// The n-th advertised ID.
    Advertised(u16),
    /// An advertised ID with bytes appended, e.g. a replica suffix that is not canonical.
    Suffixed(u16, String),
    Raw(String),
}

#[derive(Arbitrary, Debug)]
struct Container {
    available: Vec<Id>,
    must_include: Vec<Id>,
    size: i32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    shape: u8,
    replicas: u8,
    unhealthy: Vec<u16>,
    allocate: Vec<Vec<Id>>,
    prefer: Vec<Container>,
}

fn resolve(id: &Id, advertised: &[String]) -> String {
    let pick = |n: u16| advertised[usize::from(n) % advertised.len()].clone();
    match id {
        Id::Advertised(n) if !advertised.is_empty() => pick(*n),
        Id::Suffixed(n, tail) if !advertised.is_empty() => pick(*n) + tail,
        Id::Raw(text) | Id::Suffixed(_, text) => text.clone(),
        Id::Advertised(_) => String::new(),
    }
}

/// The first `most` of `ids`, each made a request ID.
fn resolve_all(ids: &[Id], most: usize, advertised: &[String]) -> Vec<String> {
    ids.iter()
        .take(most)
        .map(|id| resolve(id, advertised))
        .collect()
}

fuzz_target!(|input: Input| {
    let shape = SHAPES[usize::from(input.shape) % SHAPES.len()];
    // Bounded so one input stays fast; the size of an answer is the benchmarks' business.
    let replicas = NonZeroU32::new(u32::from(input.replicas % 8) + 1).unwrap();
    let sharing = Sharing::replicas(replicas);
    let efas: Vec<_> = simulate::devices(shape)
        .into_iter()
        .filter(|d| d.is_efa())
        .collect();
    let unhealthy: BTreeSet<usize> = input
        .unhealthy
        .iter()
        .map(|n| usize::from(*n) % efas.len().max(1))
        .collect();
    let records = efas
        .iter()
        .enumerate()
        .map(|(i, d)| DeviceRecord {
            efa: d.efa(),
            verdict: if unhealthy.contains(&i) {
                Verdict::unhealthy(Failure::DeviceNode, "fuzzed")
            } else {
                Verdict::healthy()
            },
        })
        .collect();
    let inventory = Inventory::default().observe(records).0;
    let ids: Vec<String> = inventory.devices().map(|r| r.efa.id.clone()).collect();
    let advertised: Vec<String> = ids.iter().flat_map(|id| sharing.advertised(id)).collect();
    let contributors = allocation::contributors(
        Path::new("/dev"),
        &BTreeMap::new(),
        allocation::FoundNodes::none(),
    );
    let allocator = Allocator::new(Box::new(DeviceSpecs), contributors).with_sharing(sharing);

    let request = AllocateRequest {
        container_requests: input
            .allocate
            .iter()
            .take(16)
            .map(|ids| ContainerAllocateRequest {
                devices_ids: resolve_all(ids, 256, &advertised),
            })
            .collect(),
    };
    if let Ok(response) = allocator.allocate(&inventory, &request) {
        for (asked, got) in
            per_container(&request.container_requests, &response.container_responses)
        {
            // One node per distinct EFA, never more than the IDs asked for.
            assert!(got.devices.len() <= asked.devices_ids.len());
        }
    }

    let request = PreferredAllocationRequest {
        container_requests: input
            .prefer
            .iter()
            .take(4)
            .map(|c| ContainerPreferredAllocationRequest {
                available_device_i_ds: resolve_all(&c.available, 512, &advertised),
                must_include_device_i_ds: resolve_all(&c.must_include, 64, &advertised),
                allocation_size: c.size.clamp(-1, 1024),
            })
            .collect(),
    };
    let response = allocator.preferred(&inventory, &request);
    for (asked, got) in per_container(&request.container_requests, &response.container_responses) {
        let offered: BTreeSet<&String> = asked.available_device_i_ds.iter().collect();
        let chosen: BTreeSet<&String> = got.device_i_ds.iter().collect();
        assert_eq!(
            chosen.len(),
            got.device_i_ds.len(),
            "an ID chosen twice: {got:?}"
        );
        assert!(chosen.is_subset(&offered), "an ID not offered: {got:?}");
    }
});

/// Each container's request beside its answer: an answer has exactly one per request.
fn per_container<'a, A, B>(asked: &'a [A], got: &'a [B]) -> impl Iterator<Item = (&'a A, &'a B)> {
    assert_eq!(got.len(), asked.len());
    asked.iter().zip(got)
}
