//! The plugin's memory under the loads that once took it past the pod's 64 MiB limit: scrapes
//! naming many pods with the longest names, many ListAndWatch streams, sharing counts whose
//! device list is too large for the limit, one EFA listed in hundreds of pods, and PodResources
//! answers within the 4 MiB cap that list far more than a node holds.

mod support;

use std::time::Duration;

use efa_device_plugin::proto::podresources::{
    ContainerDevices, ContainerResources, NumaNode, PodResources, TopologyInfo,
};
use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape};
use support::{Harness, sample, status_kib, try_http_get};

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

/// The burst: 100 Allocates of every ID of 256 EFAs shared 64 ways, as a client other
/// than the kubelet may send them within the record's window of IDs given out lately. The record
/// keeps one entry per advertised ID however often each is given, so the plugin stays small.
#[tokio::test]
async fn allocates_of_every_id_in_a_burst_keep_the_record_of_given_ids_small() {
    let mut h = Harness::new(Shape::Dense256);
    h.spawn_plugin(&["--sharing-replicas", "64"]);
    let view = h
        .wait("registration", |v| {
            v.stream_open && v.devices.len() == 256 * 64
        })
        .await;
    let ids: Vec<&str> = view.devices.iter().map(|d| d.id.as_str()).collect();
    let pid = h.plugin_pid();
    let before = status_kib(pid, "VmRSS");
    for _ in 0..100 {
        h.allocate(&[&ids]).await.expect("Allocate of every ID");
    }
    let (after, peak) = (status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM"));
    assert!(
        peak < BOUND_KIB,
        "VmRSS {before} KiB before the Allocates, {after} KiB after; VmHWM {peak} KiB"
    );
}

/// A kubelet listing one EFA in 600 pods (a 30 KB answer) once took the plugin to 208.6 MiB
/// with 179,700 warnings, one per pair of pods; it is one device, warned of once.
#[tokio::test]
async fn one_efa_listed_in_600_pods_is_one_warning_in_little_memory() {
    const WARNING: &str = "an EFA is double-booked";
    let mut h = Harness::new(Shape::P5);
    let efa = h.efas()[0].ibdev.clone();
    let pods = (0..600)
        .map(|i| {
            let name = format!("pod-{i:03}");
            pod("ml", &name, "main", "vpc.amazonaws.com/efa", &[&efa])
        })
        .collect();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = PodResourcesStub::start(&socket, pods).unwrap();
    h.spawn_plugin(&[]);
    h.registered().await;
    support::eventually("the warning", || h.plugin_log().contains(WARNING)).await;
    // More polls, each reading the answer again.
    let read = kubelet.lists() + 2;
    support::eventually("two more polls", || kubelet.lists() >= read).await;
    let peak = status_kib(h.plugin_pid(), "VmHWM");
    let log = h.plugin_log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(
        warnings.len(),
        1,
        "{:?}",
        &warnings[..warnings.len().min(3)]
    );
    for said in [
        &format!("device={efa}"),
        "pods=ml/pod-000,ml/pod-001",
        "more_pods=592",
    ] {
        assert!(warnings[0].contains(said), "{said} in {}", warnings[0]);
    }
    assert!(peak < BOUND_KIB, "VmHWM {peak} KiB");
}

const EFA: &str = "vpc.amazonaws.com/efa";

/// The most bytes the plugin reads of a PodResources answer (its `MAX_ANSWER`, gRPC's default
/// receive limit). An answer refused for naming a count came within it.
const ANSWER_CAP: usize = 4 << 20;

/// Held by each test that serves a large answer, so they serve one at a time: on an idle host,
/// the stub (a debug build) takes a third of the plugin's 1 s deadline to serve one.
static LARGE_ANSWERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// As many pods `pod(i)` as one answer within [`ANSWER_CAP`] holds.
fn filling_the_cap(pod: impl Fn(usize) -> PodResources) -> Vec<PodResources> {
    let mut size = 0;
    (0..)
        .map(pod)
        .take_while(|pod| {
            size += prost::encoding::message::encoded_len(1, pod);
            size <= ANSWER_CAP
        })
        .collect()
}

/// Serves a good answer, then `hostile`, and holds the plugin to [`BOUND_KIB`] while it polls
/// the answer again and again, and to what a failed poll does: one warning, here naming `says`,
/// the last view kept and marked stale, registration and `/healthz` untouched.
async fn refused_in_little_memory(hostile: Vec<PodResources>, says: &str) {
    let _turn = LARGE_ANSWERS.lock().await;
    let mut h = Harness::new(Shape::P5);
    let efa = h.efas()[0].ibdev.clone();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let trainer = vec![pod("ml", "trainer-0", "main", EFA, &[&efa])];
    let kubelet = PodResourcesStub::start(&socket, trainer.clone()).unwrap();
    h.spawn_plugin(&[]);
    h.registered().await;
    let held = format!(
        "efa_device_allocation{{device=\"{efa}\",namespace=\"ml\",pod=\"trainer-0\",container=\"main\"}}"
    );
    h.scrape_until("the trainer's EFA", |t| sample(t, &held) == Some(1.0))
        .await;
    let failures = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|line| line.contains("cannot list pod resources"))
            .map(str::to_owned)
            .collect()
    };
    for retry in 1.. {
        kubelet.serve(hostile.clone());
        let read = kubelet.lists() + 3;
        support::eventually("the answer polled twice or more", || {
            kubelet.lists() >= read
        })
        .await;
        let peak = status_kib(h.plugin_pid(), "VmHWM");
        assert!(peak < BOUND_KIB, "VmHWM {peak} KiB");
        let log = h.plugin_log();
        let failed = failures(&log);
        if failed.iter().any(|line| line.contains(says)) {
            break;
        }
        // A loaded host may let a poll of so large an answer miss the plugin's 1 s deadline:
        // that failure is logged, and the refusals after it are not. Once the view has
        // recovered, the answer is served again.
        let timed_out = failed
            .last()
            .is_some_and(|l| l.contains("no answer within"));
        assert!(timed_out && retry < 3, "{failed:#?}");
        let recovered = log.matches("can be listed again").count() + 1;
        kubelet.serve(trainer.clone());
        support::eventually("the view recovered", || {
            h.plugin_log().matches("can be listed again").count() >= recovered
        })
        .await;
    }
    let failed = failures(&h.plugin_log());
    let refused = failed.iter().filter(|line| line.contains(says)).count();
    assert_eq!(refused, 1, "{failed:#?}");
    let text = h
        .scrape_until("the view kept, stale", |t| {
            sample(t, "efa_device_plugin_pod_resources_stale") == Some(1.0)
        })
        .await;
    assert_eq!(sample(&text, &held), Some(1.0), "{text}");
    assert_eq!(h.get("/healthz").await, (200, "ok\n".into()));
    h.registered().await;
}

/// 77,000 pods of one tiny container each, holding one EFA, fill the 4 MiB: decoded by prost's
/// types they once took the plugin to 134–153 MiB.
#[tokio::test]
async fn an_answer_of_77000_tiny_pods_is_refused_in_little_memory() {
    let pods = filling_the_cap(|i| pod("ml", &i.to_string(), "c", EFA, &["rdmap79s0"]));
    assert!(pods.len() > 70_000, "{}", pods.len());
    let says = format!(
        "the answer lists {} pods, more than the 4096 a node runs",
        pods.len()
    );
    refused_in_little_memory(pods, &says).await;
}

/// About 9,800 pods with the longest names Kubernetes accepts, each holding one EFA: once 46 MiB.
#[tokio::test]
async fn an_answer_of_9800_pods_with_the_longest_names_is_refused_in_little_memory() {
    let pods = filling_the_cap(|i| {
        let (namespace, name) = (
            support::longest_name("ns", i % 4, 63),
            support::longest_name("pod", i, 253),
        );
        pod(
            &namespace,
            &name,
            &support::longest_name("c", i, 63),
            EFA,
            &["rdmap79s0"],
        )
    });
    assert!(pods.len() > 9_000, "{}", pods.len());
    let says = format!("the answer lists {} pods", pods.len());
    refused_in_little_memory(pods, &says).await;
}

/// One container listing half a million one-character IDs: 3 bytes each on the wire, a
/// `String` each once decoded. 1.4 million fill the 4 MiB and once took the plugin to 113 MiB,
/// but the stub, a debug build, cannot serve them within the plugin's 1 s deadline.
#[tokio::test]
async fn a_container_listing_half_a_million_ids_is_refused_in_little_memory() {
    let ids = vec!["x"; 500_000];
    let flood = vec![pod("ml", "flood", "main", EFA, &ids)];
    let says = format!(
        "the answer lists {} device IDs, more than the 131072 a node advertises",
        ids.len()
    );
    refused_in_little_memory(flood, &says).await;
}

/// One held device ID as the kubelet lists it (`containerDevicesFromResourceDeviceInstances`): a
/// device group of its own, with the device's NUMA node.
fn as_the_kubelet_lists(resource: &str, id: String, numa: i32) -> ContainerDevices {
    ContainerDevices {
        resource_name: resource.into(),
        device_ids: vec![id],
        topology: Some(TopologyInfo {
            nodes: vec![NumaNode { id: numa.into() }],
        }),
    }
}

/// A p5 shared 64 ways with every ID held by 64 pods with the longest names, listed as the
/// kubelet lists them: a legitimate large answer, read whole.
#[tokio::test]
async fn every_id_of_a_p5_shared_64_ways_held_is_read_as_the_kubelet_lists_it() {
    let mut h = Harness::new(Shape::P5);
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let pods: Vec<PodResources> = (0..64)
        .map(|k| PodResources {
            name: support::longest_name("pod", k, 253),
            namespace: support::longest_name("ns", k % 4, 63),
            containers: vec![ContainerResources {
                name: support::longest_name("c", k, 63),
                devices: efas
                    .iter()
                    .map(|efa| as_the_kubelet_lists(EFA, format!("{}::{k}", efa.ibdev), efa.numa))
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _kubelet = PodResourcesStub::start(&socket, pods).unwrap();
    shared_p5(&mut h, &[]).await;
    let text = h
        .scrape_until("every holder named", |t| {
            t.matches("efa_device_allocation{").count() == 64 * 32
        })
        .await;
    assert_eq!(
        sample(&text, "efa_device_plugin_pod_resources_stale"),
        Some(0.0)
    );
    assert!(!h.plugin_log().contains("cannot list pod resources"));
    let peak = status_kib(h.plugin_pid(), "VmHWM");
    assert!(peak < BOUND_KIB, "VmHWM {peak} KiB");
}

/// 50,000 GPUs of 500 pods held, as the kubelet lists them: just within the 16 MiB an answer
/// may take decoded, so read, and within the bound.
#[tokio::test]
async fn an_answer_just_within_what_it_may_take_decoded_is_read_within_the_bound() {
    let _turn = LARGE_ANSWERS.lock().await;
    let mut h = Harness::new(Shape::P5);
    let pods: Vec<PodResources> = (0..500)
        .map(|p| PodResources {
            name: format!("pod-{p}"),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices: (0..100)
                    .map(|g| as_the_kubelet_lists("nvidia.com/gpu", format!("GPU-{p}-{g}"), 0))
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .collect();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = PodResourcesStub::start(&socket, pods).unwrap();
    h.spawn_plugin(&[]);
    h.registered().await;
    h.scrape_until("the view known", |t| {
        sample(t, "efa_device_plugin_pod_resources_unknown") == Some(0.0)
    })
    .await;
    let read = kubelet.lists() + 2;
    support::eventually("two more polls", || kubelet.lists() >= read).await;
    // Read, not refused (a loaded host may still let a poll miss its deadline).
    assert!(!h.plugin_log().contains("error=the answer"));
    let peak = status_kib(h.plugin_pid(), "VmHWM");
    assert!(peak < BOUND_KIB, "VmHWM {peak} KiB");
}
