//! The plugin's memory under the loads that once took it past the pod's 64 MiB limit: scrapes
//! naming many pods with the longest names, many ListAndWatch streams, and sharing counts whose
//! device list is too large for the limit.

mod support;

use std::time::Duration;

use efa_device_plugin::testkit::pod_resources_stub::PodResourcesStub;
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape};
use support::{Harness, status_kib, try_http_get};

/// Well under the pod's 64 MiB limit, with room for a debug build's larger code.
const BOUND_KIB: u64 = 40 * 1024;

/// A p5 shared 64 ways, registered, with every ID listed.
async fn shared_p5(h: &mut Harness, extra: &[&str]) {
    let mut args = vec!["--sharing-replicas", "64"];
    args.extend(extra);
    h.spawn_plugin(&args);
    let ids = h.efas().len() * 64;
    h.wait("registration", |v| v.stream_open && v.devices.len() == ids)
        .await;
}

#[tokio::test]
async fn the_connection_cap_of_scrapes_naming_the_longest_pods_stays_small() {
    let mut h = Harness::new(Shape::P5);
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let pods = support::pods_holding_every_efa(&efas, 64);
    let last_pod = pods[63].name.clone();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _stub = PodResourcesStub::start(&socket, pods).unwrap();
    shared_p5(&mut h, &[]).await;
    let address = h.metrics_address().await;
    let cap = efa_device_plugin::telemetry::fds::MAX_CONNECTIONS;
    for _ in 0..3 {
        // The last round's slots are given back once the plugin has closed its connections.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut scrapes = tokio::task::JoinSet::new();
        for _ in 0..cap {
            scrapes.spawn(try_http_get(address, "/metrics"));
        }
        // A slow build may miss the connection deadline on some; those are not the point.
        for (status, text) in scrapes.join_all().await.into_iter().flatten() {
            assert_eq!(status, 200);
            // One series per holder: 64 on each of the 32 EFAs.
            let named = text.matches("efa_device_allocation{").count();
            assert!(named == 0 || named == 64 * 32, "{named} allocations");
            assert!(named == 0 || text.contains(&last_pod));
        }
    }
    let peak = status_kib(h.plugin_pid(), "VmHWM");
    assert!(
        peak < BOUND_KIB,
        "VmHWM {peak} KiB after {cap} concurrent scrapes, three times"
    );
}

#[tokio::test]
async fn listandwatch_streams_past_the_cap_are_refused_and_the_rest_share_one_list() {
    let mut h = Harness::new(Shape::P5);
    shared_p5(&mut h, &[]).await;
    let ids = h.efas().len() * 64;
    let (mut open, mut refused) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        match support::open_list_stream(&h).await {
            Ok((stream, list)) => {
                assert_eq!(list.devices.len(), ids);
                open.push(stream);
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
                assert!(status.message().contains("at most 8"), "{status}");
                refused.push(status.message().to_owned());
            }
        }
    }
    assert_eq!((open.len(), refused.len()), (8, 32), "{refused:?}");
    // Every open stream, and the kubelet's, follows the next change.
    let failed = h.efas()[0].clone();
    h.node.remove_node(&failed).unwrap();
    for stream in &mut open {
        let list = tokio::time::timeout(support::TIMEOUT, stream.message())
            .await
            .expect("the new list in time")
            .unwrap()
            .unwrap();
        assert_eq!(
            list.devices
                .iter()
                .filter(|d| d.health == "Unhealthy")
                .count(),
            64
        );
    }
    h.wait("the kubelet's new list", |v| v.healthy() == ids - 64)
        .await;
    // A closed stream frees its slot.
    open.pop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    support::open_list_stream(&h).await.expect("a freed slot");
    let peak = status_kib(h.plugin_pid(), "VmHWM");
    assert!(peak < BOUND_KIB, "VmHWM {peak} KiB");
}
