//! GetPreferredAllocation through the kubelet stand-in, against the real binary: advertised in
//! the options, answered for whatever the kubelet sends, and consistent with the NUMA topology
//! the kubelet's topology manager builds its hints from.

mod support;

use std::collections::BTreeSet;

use efa_device_plugin::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest, device_plugin_client::DevicePluginClient,
};
use efa_device_plugin::testkit::kubelet_stub::KubeletView;
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, eventually};
use tonic::transport::Channel;

fn offer(available: &[String], must: &[&str], size: i32) -> ContainerPreferredAllocationRequest {
    ContainerPreferredAllocationRequest {
        available_device_i_ds: available.to_vec(),
        must_include_device_i_ds: must.iter().map(|s| s.to_string()).collect(),
        allocation_size: size,
    }
}

/// One GetPreferredAllocation call, as the kubelet makes it; the answer per container.
async fn prefer(
    client: &mut DevicePluginClient<Channel>,
    containers: Vec<ContainerPreferredAllocationRequest>,
) -> Vec<Vec<String>> {
    let response = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: containers,
        })
        .await
        .unwrap()
        .into_inner();
    response
        .container_responses
        .into_iter()
        .map(|c| c.device_i_ds)
        .collect()
}

/// The kubelet's `generateDeviceTopologyHints` on a two-socket machine: every NUMA mask that
/// holds enough devices, and whether it is preferred (as narrow as the narrowest that could).
fn hints(view: &KubeletView, request: usize) -> Option<Vec<(BTreeSet<i64>, bool)>> {
    if view.devices.iter().all(|d| d.topology.is_none()) {
        return None;
    }
    let masks: [BTreeSet<i64>; 3] = [[0].into(), [1].into(), [0, 1].into()];
    let fits = |mask: &BTreeSet<i64>| {
        let inside = view
            .devices
            .iter()
            .filter(|d| view.numa_of(&d.id).is_some_and(|n| mask.contains(&n)))
            .count();
        inside >= request
    };
    let narrowest = masks.iter().filter(|m| fits(m)).map(|m| m.len()).min();
    Some(
        masks
            .iter()
            .filter(|m| fits(m))
            .map(|m| (m.clone(), Some(m.len()) == narrowest))
            .collect(),
    )
}

#[tokio::test]
async fn p5_answers_are_local_and_allocatable() {
    let mut h = Harness::new(Shape::P5);
    // PCI IDs, so each expected answer shows where its EFAs sit.
    h.spawn_plugin(&["--device-id-strategy", "pci"]);
    let view = h.registered().await;
    assert!(view.options.unwrap().get_preferred_allocation_available);
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();

    let mut client = h.kubelet.plugin().unwrap();
    let answers = prefer(
        &mut client,
        vec![
            offer(&all, &[], 4),
            offer(&all, &["0000:a5:00.0"], 8),
            offer(&all, &[], 16),
        ],
    )
    .await;
    assert_eq!(
        answers[0],
        [
            "0000:4f:00.0",
            "0000:50:00.0",
            "0000:51:00.0",
            "0000:52:00.0"
        ]
    );
    assert_eq!(answers[1].len(), 8);
    assert!(answers[1].contains(&"0000:a5:00.0".to_owned()));
    for (answer, numa) in [(&answers[1], 1), (&answers[2], 0)] {
        for id in answer {
            assert_eq!(view.numa_of(id), Some(numa), "{answer:?}");
        }
    }

    // What the kubelet then does with the answer: Allocate exactly those IDs.
    let allocated = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: answers[0].clone(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(allocated.container_responses[0].devices.len(), 4);
}

#[tokio::test]
async fn anything_the_kubelet_can_send_gets_an_answer() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let foreign = vec!["0000:ff:00.0".to_owned(), all[3].clone(), all[3].clone()];
    let mut client = h.kubelet.plugin().unwrap();
    let answers = prefer(
        &mut client,
        vec![
            offer(&[], &[], 2),
            offer(&all, &[], 0),
            offer(&all, &[], -1),
            offer(&all, &[], 40),
            offer(&foreign, &["0000:ff:00.0"], 2),
        ],
    )
    .await;
    assert_eq!(
        answers,
        [vec![], vec![], vec![], all.clone(), vec![all[3].clone()]]
    );
    assert!(prefer(&mut client, Vec::new()).await.is_empty());
}

/// At debug level every answer is logged with its offer, so the kubelet's NUMA filtering can
/// be read from the plugin's log.
#[tokio::test]
async fn each_answer_is_logged_with_its_offer_at_debug_level() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--log-level", "info,efa_device_plugin=debug"]);
    let view = h.registered().await;
    let numa1: Vec<String> = view
        .devices
        .iter()
        .filter(|d| view.numa_of(&d.id) == Some(1))
        .map(|d| d.id.clone())
        .collect();
    let mut client = h.kubelet.plugin().unwrap();
    let answers = prefer(
        &mut client,
        vec![offer(&numa1, &[], 1), offer(&numa1, &[&numa1[1]], 2)],
    )
    .await;
    let lines = [
        format!(
            "offered={} must_include= size=1 answer={}",
            numa1.join(","),
            answers[0].join(",")
        ),
        format!(
            "offered={} must_include={} size=2 answer={}",
            numa1.join(","),
            numa1[1],
            answers[1].join(",")
        ),
    ];
    eventually("both answers in the log", || {
        let log = h.plugin_log();
        lines.iter().all(|line| {
            log.lines()
                .any(|l| l.contains("answered GetPreferredAllocation") && l.contains(line))
        })
    })
    .await;
}

/// `single-numa-node` admits a p5 pod only when its EFAs fit one socket; `restricted` also
/// admits a whole-node pod, because the two-socket hint is then the narrowest possible. A g5
/// reports no topology, which every policy reads as "no preference".
#[tokio::test]
async fn reported_topology_gives_the_kubelet_usable_hints() {
    let mut h = Harness::new(Shape::P5);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    assert!(view.devices.iter().all(|d| {
        d.topology
            .as_ref()
            .is_some_and(|t| t.nodes.len() == 1 && t.nodes[0].id <= 1)
    }));
    let single = |hints: &[(BTreeSet<i64>, bool)]| {
        hints
            .iter()
            .any(|(mask, preferred)| *preferred && mask.len() == 1)
    };
    assert!(single(&hints(&view, 16).unwrap()));
    let whole_node = hints(&view, 32).unwrap();
    assert!(!single(&whole_node));
    assert_eq!(whole_node, [([0, 1].into(), true)]);

    let mut g5 = Harness::new(Shape::G5);
    g5.spawn_plugin(&[]);
    assert_eq!(hints(&g5.registered().await, 1), None);
}

/// A kubelet up to 1.37 can lose track of IDs it is allocating (kubernetes PR #137534) and offer
/// them to the next pod while the first holds them. Preferences rank by topology alone, so the
/// next pod would be preferred the very IDs just given out; the plugin steers it to others while
/// any remain. A correct kubelet never offers them, so its answers do not change; under sharing
/// another replica of the same EFA is fine.
#[tokio::test]
async fn ids_just_given_out_are_preferred_last_if_the_kubelet_offers_them_again() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--device-id-strategy", "pci"]);
    let view = h.registered().await;
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let first = h.prefer(all.clone(), 2).await;
    assert_eq!(first, ["0000:10:1b.0", "0000:20:1b.0"]);
    let ids: Vec<&str> = first.iter().map(String::as_str).collect();
    h.allocate(&[&ids]).await.unwrap();

    // The kubelet lost track of them and offers all four again.
    assert_eq!(
        h.prefer(all.clone(), 2).await,
        ["0000:90:1b.0", "0000:a0:1b.0"]
    );
    // Nothing else to give: the request is still met.
    assert_eq!(h.prefer(all.clone(), 4).await, all);
    // A correct kubelet offers only the free ones: the same answer as without steering.
    let free: Vec<String> = all
        .iter()
        .filter(|id| !first.contains(id))
        .cloned()
        .collect();
    assert_eq!(h.prefer(free, 2).await, ["0000:90:1b.0", "0000:a0:1b.0"]);
    // What the kubelet must include is included.
    let mut client = h.kubelet.plugin().unwrap();
    let answer = prefer(&mut client, vec![offer(&all, &["0000:10:1b.0"], 2)]).await;
    assert!(answer[0].contains(&"0000:10:1b.0".to_owned()), "{answer:?}");
}

#[tokio::test]
async fn under_sharing_another_replica_of_an_efa_just_given_out_is_fine() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--device-id-strategy", "pci", "--sharing-replicas", "2"]);
    let replicas = 2 * h.efas().len();
    let view = h
        .wait("registration", |v| {
            v.stream_open && v.devices.len() == replicas
        })
        .await;
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(h.prefer(all.clone(), 1).await, ["0000:10:1b.0::0"]);
    h.allocate(&[&["0000:10:1b.0::0"]]).await.unwrap();
    assert_eq!(h.prefer(all, 1).await, ["0000:10:1b.0::1"]);
}
