//! The real binary against the kubelet stand-in: registration, ListAndWatch, health, Allocate
//! and every way the kubelet or the node can pull the rug.

mod support;

use std::time::Duration;

use efa_device_plugin::proto::deviceplugin::{HEALTHY, UNHEALTHY};
use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::{Nodes, Shape, make_char_device};
use support::{Harness, eventually, fds_and_tasks, node_kind};
use tonic::Code;

fn ids(view: &efa_device_plugin::testkit::kubelet_stub::KubeletView) -> Vec<String> {
    view.devices.iter().map(|d| d.id.clone()).collect()
}

/// [`ids`], sorted.
fn sorted_ids(view: &efa_device_plugin::testkit::kubelet_stub::KubeletView) -> Vec<String> {
    let mut ids = ids(view);
    ids.sort();
    ids
}

/// A kubelet's PodResources stand-in at `h`'s socket, saying `trainer-0` holds the EFA `id`.
fn kubelet_with_a_pod_holding(h: &Harness, id: &str) -> PodResourcesStub {
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let holder = pod("ml", "trainer-0", "main", "vpc.amazonaws.com/efa", &[id]);
    PodResourcesStub::start(&socket, vec![holder]).unwrap()
}

#[tokio::test]
async fn registers_and_lists_p4d_with_numa() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    let request = view.last_request.clone().unwrap();
    assert_eq!(request.version, "v1beta1");
    assert_eq!(request.endpoint, "efa-device-plugin.sock");
    assert_eq!(request.resource_name, "vpc.amazonaws.com/efa");
    assert_eq!(
        ids(&view),
        ["rdmap144s27", "rdmap160s27", "rdmap16s27", "rdmap32s27"]
    );
    assert!(view.devices.iter().all(|d| d.health == HEALTHY));
    assert_eq!(view.numa_of("rdmap16s27"), Some(0));
    assert_eq!(view.numa_of("rdmap32s27"), Some(0));
    assert_eq!(view.numa_of("rdmap144s27"), Some(1));
    assert_eq!(view.numa_of("rdmap160s27"), Some(1));
    assert_eq!(view.register_calls, 1);
}

/// Renames as the kubelet sees them: udev's of an EFA nobody holds, and `rdma dev set` of one a
/// pod holds. Each EFA is listed once, under one ID, and a held ID stays until it is released.
#[tokio::test]
async fn a_renamed_efa_is_listed_once_and_keeps_an_id_a_pod_holds() {
    let mut h = Harness::new(Shape::Bottlerocket);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = kubelet_with_a_pod_holding(&h, "efa_1");
    h.spawn_plugin(&["--rescan-interval", "200ms"]);
    h.registered().await;
    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    h.node.rename(&efas[0], "rdmap16s27").unwrap();
    h.node.rename(&efas[1], "rdmap32s27").unwrap();
    let sorted = sorted_ids;
    h.wait("efa_0 under its new name, efa_1 kept", |v| {
        sorted(v) == ["efa_1", "efa_2", "efa_3", "rdmap16s27"] && v.healthy() == 4
    })
    .await;
    // Several rescans later, still one ID for the held EFA.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let view = h.kubelet.view().borrow().clone();
    assert_eq!(sorted(&view), ["efa_1", "efa_2", "efa_3", "rdmap16s27"]);
    assert_eq!(view.healthy(), 4);

    // The pod ends.
    drop(kubelet);
    let _kubelet = PodResourcesStub::start(&socket, Vec::new()).unwrap();
    h.wait("efa_1 under its new name", |v| {
        sorted(v) == ["efa_2", "efa_3", "rdmap16s27", "rdmap32s27"] && v.healthy() == 4
    })
    .await;
}

/// A held EFA renamed while no plugin ran (a rollout, a crash): the restarted plugin lists it
/// under the ID the pod holds, not as a new, free EFA whose node the kubelet would give to a
/// second pod; once the pod is gone, the new name takes over.
#[tokio::test]
async fn a_held_efa_renamed_while_no_plugin_ran_keeps_its_id() {
    let mut h = Harness::new(Shape::Bottlerocket);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = kubelet_with_a_pod_holding(&h, "efa_0");
    h.spawn_plugin(&[]);
    h.registered().await;
    let ids_file = h
        .plugin_socket()
        .with_file_name("efa-device-plugin.ids.json");
    eventually("the file of advertised IDs", || ids_file.exists()).await;
    let (status, _) = h.terminate_plugin();
    assert!(status.success());
    assert!(ids_file.exists(), "kept on exit");

    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    h.node.rename(&efas[0], "rdmap16s27").unwrap();
    h.spawn_plugin(&[]);
    let sorted = sorted_ids;
    let held = ["efa_0", "efa_1", "efa_2", "efa_3"];
    h.wait("the held EFA under its held ID", |v| {
        v.register_calls == 2 && v.stream_open && sorted(v) == held
    })
    .await;
    // Several rescans and PodResources answers later, still so.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sorted(&h.kubelet.view().borrow()), held);

    drop(kubelet);
    let _kubelet = PodResourcesStub::start(&socket, Vec::new()).unwrap();
    h.wait("the released EFA under its new name", |v| {
        sorted(v) == ["efa_1", "efa_2", "efa_3", "rdmap16s27"]
    })
    .await;
}

/// An EFA renamed right after Allocate gave it out, before the PodResources view lists its pod:
/// the ID given out stays, so the kubelet cannot count the new name free.
#[tokio::test]
async fn an_efa_renamed_right_after_allocate_keeps_the_id_given_out() {
    let mut h = Harness::new(Shape::Bottlerocket);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    // A kubelet whose answer does not show the pod yet.
    let _kubelet = PodResourcesStub::start(&socket, Vec::new()).unwrap();
    h.spawn_plugin(&["--rescan-interval", "200ms"]);
    h.registered().await;
    h.allocate(&[&["efa_1"]]).await.unwrap();
    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    h.node.rename(&efas[1], "rdmap32s27").unwrap();
    // Several rescans and PodResources answers.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        sorted_ids(&h.kubelet.view().borrow()),
        ["efa_0", "efa_1", "efa_2", "efa_3"]
    );
}

#[tokio::test]
async fn p6_b200_mlx5_decoys_are_not_advertised() {
    let mut h = Harness::new(Shape::P6B200);
    assert_eq!(h.devices.len(), 10);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    assert_eq!(view.devices.len(), 8);
    let decoys: Vec<_> = h.devices.iter().filter(|d| !d.is_efa()).collect();
    for decoy in decoys {
        assert!(
            view.health_of(&decoy.ibdev).is_none(),
            "{} advertised",
            decoy.ibdev
        );
    }
}

#[tokio::test]
async fn g5_without_numa_reports_no_topology() {
    let mut h = Harness::new(Shape::G5);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    assert_eq!(view.devices.len(), 1);
    assert!(view.devices[0].topology.is_none());
}

#[tokio::test]
async fn no_efa_registers_empty_and_picks_up_a_late_device() {
    for shape in [Shape::NoEfa, Shape::NoClassDir] {
        let mut h = Harness::new(shape);
        h.spawn_plugin(&[]);
        let view = h
            .wait("an empty registration", |v| {
                v.stream_open && v.snapshots > 0
            })
            .await;
        assert!(view.devices.is_empty());
        // The driver loads late: the device shows up within the rescan interval. A rescan may
        // catch it half-created (sysfs there, node not yet), so it may be Unhealthy at first.
        let late = efa_device_plugin::testkit::simulate::devices(Shape::P4d).remove(0);
        std::fs::create_dir_all(h.node.sysfs.join("class/infiniband")).unwrap();
        std::fs::create_dir_all(h.node.sysfs.join("class/infiniband_verbs")).unwrap();
        h.node.add(&late).unwrap();
        let view = h
            .wait("the late device", |v| {
                v.devices.len() == 1 && v.healthy() == 1
            })
            .await;
        assert_eq!(view.devices[0].id, late.ibdev);
        assert_eq!(view.devices[0].health, HEALTHY);
    }
}

#[tokio::test]
async fn allocate_returns_exactly_the_allocated_nodes() {
    let mut h = Harness::new(Shape::P5);
    h.spawn_plugin(&[]);
    h.registered().await;
    let chosen: Vec<_> = h.efas().into_iter().take(8).cloned().collect();
    let ids: Vec<&str> = chosen.iter().map(|d| d.ibdev.as_str()).collect();
    let response = h.allocate(&[&ids]).await.unwrap();
    assert_eq!(response.container_responses.len(), 1);
    let container = &response.container_responses[0];
    assert!(container.envs.is_empty() && container.mounts.is_empty());
    let mut got: Vec<_> = container
        .devices
        .iter()
        .map(|s| {
            (
                s.container_path.clone(),
                s.host_path.clone(),
                s.permissions.clone(),
            )
        })
        .collect();
    let mut want: Vec<_> = chosen
        .iter()
        .map(|d| {
            (
                format!("/dev/infiniband/{}", d.uverbs_name()),
                h.node.node_path(d).display().to_string(),
                "rw".to_owned(),
            )
        })
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

#[tokio::test]
async fn allocate_refuses_unknown_and_unhealthy_ids_by_name() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let err = h
        .allocate(&[&["rdmap16s27", "0000:10:1b.0"]])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // The other strategy's name for an EFA is as unknown as a made-up ID.
    assert!(err.message().contains("0000:10:1b.0"), "{}", err.message());

    let victim = h.efas()[2].clone();
    h.node.remove_node(&victim).unwrap();
    h.wait("the failure", |v| {
        v.health_of(&victim.ibdev) == Some(UNHEALTHY)
    })
    .await;
    let err = h.allocate(&[&[&victim.ibdev]]).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains(&victim.ibdev), "{}", err.message());
}

#[tokio::test]
async fn node_removal_shows_without_waiting_for_a_rescan() {
    let mut h = Harness::new(Shape::P4d);
    // A rescan interval far beyond the test's patience: only inotify can explain a quick change.
    h.spawn_plugin(&["--rescan-interval", "1h"]);
    h.registered().await;
    let victim = h.efas()[0].clone();
    h.node.remove_node(&victim).unwrap();
    let view = h
        .wait("the removal", |v| {
            v.health_of(&victim.ibdev) == Some(UNHEALTHY)
        })
        .await;
    assert_eq!(view.healthy(), 3);
    h.node.create_node(&victim).unwrap();
    h.wait("the recovery", |v| v.healthy() == 4).await;
}

#[tokio::test]
async fn vanished_device_stays_listed_unhealthy_and_recovers() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let victim = h.efas()[1].clone();
    h.node.remove(&victim).unwrap();
    let view = h
        .wait("the vanished device", |v| {
            v.health_of(&victim.ibdev) == Some(UNHEALTHY)
        })
        .await;
    assert_eq!(view.devices.len(), 4, "a vanished device stays in capacity");
    h.node.add(&victim).unwrap();
    h.wait("the returned device", |v| v.healthy() == 4).await;

    // Unbinding the driver alone is a failure too.
    h.node.unbind(&victim).unwrap();
    h.wait("the unbound device", |v| {
        v.health_of(&victim.ibdev) == Some(UNHEALTHY)
    })
    .await;
    h.node.bind(&victim).unwrap();
    h.wait("the rebound device", |v| v.healthy() == 4).await;
}

/// An EFA whose driver closed its admin queue stays in sysfs with its node, yet no pod can use
/// it: the kubelet is told Unhealthy, the metrics count it by reason, and it is Healthy again
/// once the device is probed again, with its counters at 0. A plugin started after the failure
/// sees it, as a restart or an upgrade would.
#[tokio::test]
async fn an_efa_whose_admin_queue_closed_is_unhealthy_until_probed_again() {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    h.node
        .set_device_counter(&efas[0], "no_completion_cmds", 2)
        .unwrap();
    h.spawn_plugin(&[]);
    h.wait("the EFA closed before the start", |v| {
        v.devices.len() == 4 && v.health_of(&efas[0].ibdev) == Some(UNHEALTHY) && v.healthy() == 3
    })
    .await;

    h.node
        .set_device_counter(&efas[2], "no_completion_cmds", 1)
        .unwrap();
    h.wait("the EFA closed while running", |v| {
        v.health_of(&efas[2].ibdev) == Some(UNHEALTHY) && v.healthy() == 2
    })
    .await;
    let text = h
        .scrape_until("two closed admin queues counted", |text| {
            support::sample(
                text,
                "efa_device_plugin_unhealthy_devices{reason=\"admin_queue_closed\"}",
            ) == Some(2.0)
        })
        .await;
    assert_eq!(
        support::sample(
            &text,
            "efa_device_plugin_unhealthy_devices{reason=\"vanished\"}"
        ),
        Some(0.0),
        "every reason is shown, 0 included"
    );

    // Probed again: the driver re-creates the device, and its counters start at 0.
    h.node.remove(&efas[0]).unwrap();
    h.node.add(&efas[0]).unwrap();
    h.wait("the EFA probed again", |v| {
        v.health_of(&efas[0].ibdev) == Some(HEALTHY) && v.healthy() == 3
    })
    .await;
    let log = h.plugin_log();
    let unhealthy: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("device unhealthy"))
        .collect();
    assert!(
        unhealthy
            .iter()
            .any(|line| line.contains(&efas[2].ibdev) && line.contains("closed its admin queue")),
        "{log}"
    );
}

/// `--admin-queue-health=false`: the counter changes no device's health.
#[tokio::test]
async fn the_admin_queue_rule_turned_off_leaves_the_efa_healthy() {
    let mut h = Harness::new(Shape::P4d);
    let efa = h.efas()[1].clone();
    h.node
        .set_device_counter(&efa, "no_completion_cmds", 5)
        .unwrap();
    h.spawn_plugin(&["--admin-queue-health=false"]);
    let view = h.registered().await;
    assert_eq!(view.healthy(), 4);
}

#[tokio::test]
async fn renamed_ibdev_keeps_its_pci_id() {
    let mut h = Harness::new(Shape::Bottlerocket);
    h.spawn_plugin(&["--device-id-strategy", "pci"]);
    let before = ids(&h.registered().await);
    // rdma-core's udev rule renames efa_N to its PCI name: a PCI ID must not move.
    let mut renamed = h.efas()[0].clone();
    h.node.remove(&renamed).unwrap();
    renamed.ibdev = "rdmap16s27".into();
    h.node.add(&renamed).unwrap();
    // A rename that completes between two scans changes nothing the kubelet sees, so the
    // plugin's own view (the ibdev label of the counters) tells when it noticed.
    let renamed_series = format!(
        "efa_tx_bytes_total{{device=\"{}\",ibdev=\"rdmap16s27\"}}",
        renamed.bdf
    );
    h.scrape_until("the renamed device", |t| {
        support::sample(t, &renamed_series).is_some()
    })
    .await;
    let view = h.wait("the renamed device", |v| v.healthy() == 4).await;
    assert_eq!(ids(&view), before);
}

#[tokio::test]
async fn mismatched_char_device_is_unhealthy() {
    if node_kind() != Nodes::CharDevices {
        eprintln!("skipped: creating character devices needs CAP_MKNOD");
        return;
    }
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let victim = h.efas()[3].clone();
    let path = h.node.node_path(&victim);
    std::fs::remove_file(&path).unwrap();
    let mut wrong = victim.dev;
    wrong.minor += 100;
    make_char_device(&path, wrong).unwrap();
    h.wait("the mismatch", |v| {
        v.health_of(&victim.ibdev) == Some(UNHEALTHY)
    })
    .await;
    assert!(h.plugin_log().contains("sysfs says"), "{}", h.plugin_log());
}

#[tokio::test]
async fn dense_node_reads_dynamic_majors() {
    let mut h = Harness::new(Shape::Dense256);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    assert_eq!(view.devices.len(), 256);
    assert_eq!(view.healthy(), 256, "{}", h.plugin_log());
}

#[tokio::test]
async fn waits_for_a_missing_kubelet() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet.restart().await.unwrap();
    std::fs::remove_file(h.plugin_dir.join("kubelet.sock")).unwrap();
    h.spawn_plugin(&[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(h.plugin_pid() as i32), None).is_ok(),
        "the plugin must wait, not exit"
    );
    h.kubelet.restart().await.unwrap();
    h.registered().await;
}

#[tokio::test]
async fn kubelet_restarts_leak_nothing() {
    let mut h = Harness::new(Shape::P4d);
    let pid = h.spawn_plugin(&[]);
    h.registered().await;
    // Let lazily created runtime threads appear before taking the baseline.
    h.kubelet.restart().await.unwrap();
    h.registered().await;
    // The rescan and the DRA guard each run on a blocking-pool thread every interval, so one or
    // two such threads exist at a time: the baseline is the most seen over a few intervals.
    let (mut fds_before, mut tasks_before) = fds_and_tasks(pid);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (fds, tasks) = fds_and_tasks(pid);
        (fds_before, tasks_before) = (fds_before.max(fds), tasks_before.max(tasks));
    }
    for round in 0..20 {
        let calls = h.kubelet.view().borrow().register_calls;
        h.kubelet.restart().await.unwrap();
        h.wait(&format!("re-registration {round}"), |v| {
            v.register_calls > calls && v.stream_open && v.devices.len() == 4
        })
        .await;
    }
    // The last restart's old connection may still be closing; a leak would not go away.
    support::eventually("fds and tasks back to their baseline", || {
        let (fds, tasks) = fds_and_tasks(pid);
        fds <= fds_before && tasks <= tasks_before
    })
    .await;
}

#[tokio::test]
async fn stream_ended_by_the_kubelet_leads_to_registration() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    for round in 0..3 {
        let started = h.kubelet.view().borrow().streams_started;
        h.kubelet.end_stream();
        h.wait(&format!("registration after stream end {round}"), |v| {
            v.streams_started > started && v.stream_open && v.healthy() == 4
        })
        .await;
    }
}

#[tokio::test]
async fn deleted_socket_leads_to_registration() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    let before = h.registered().await.register_calls;
    std::fs::remove_file(h.plugin_socket()).unwrap();
    h.wait("registration after socket deletion", |v| {
        v.register_calls > before && v.stream_open && v.healthy() == 4
    })
    .await;
    assert!(h.plugin_socket().exists());
}

#[tokio::test]
async fn sigterm_removes_the_socket_and_exits_zero() {
    for signal in [
        nix::sys::signal::Signal::SIGTERM,
        nix::sys::signal::Signal::SIGINT,
    ] {
        let mut h = Harness::new(Shape::P4d);
        h.spawn_plugin(&[]);
        h.registered().await;
        assert!(h.plugin_socket().exists());
        let (status, took) = h.stop_plugin(signal);
        assert!(status.success(), "{signal}: {status:?}\n{}", h.plugin_log());
        assert!(took < Duration::from_secs(2), "{signal}: took {took:?}");
        assert!(!h.plugin_socket().exists());
    }
}

#[tokio::test]
async fn ids_survive_a_plugin_restart() {
    let mut h = Harness::new(Shape::P5);
    h.spawn_plugin(&[]);
    let before = ids(&h.registered().await);
    h.terminate_plugin();
    h.wait("the stream end", |v| !v.stream_open).await;
    h.spawn_plugin(&[]);
    let after = ids(&h.registered().await);
    assert_eq!(before, after);
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered_and_logged().await;
    h.terminate_plugin();
    let log = h.plugin_log();
    assert!(log.contains("stopping on signal"), "{log}");
    for line in log.lines() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(value.get("message").is_some(), "{line}");
    }
}

/// Unmounts a test's tmpfs however the test ends.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[tokio::test]
async fn a_full_disk_delays_registration_without_killing_the_plugin() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    }
    let mut h = Harness::new(Shape::P4d);
    // A tmpfs with room for its root, kubelet.sock and nothing else: binding a socket fails
    // with ENOSPC, as on a node whose disk is full.
    nix::mount::mount(
        Some("tmpfs"),
        &h.plugin_dir,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=64k,nr_inodes=3"),
    )
    .expect("mount tmpfs");
    let _mounted = Mounted(h.plugin_dir.clone());
    h.kubelet.restart().await.unwrap();
    let mut fillers = Vec::new();
    for n in 0.. {
        let path = h.plugin_dir.join(format!("filler-{n}"));
        if std::fs::write(&path, b"").is_err() {
            break;
        }
        fillers.push(path);
    }
    h.spawn_plugin(&[]);
    support::eventually("the bind failure to be logged", || {
        h.plugin_log().contains("No space left on device")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(h.plugin_pid() as i32), None).is_ok(),
        "the plugin must keep retrying, not exit\n{}",
        h.plugin_log()
    );
    assert_eq!(h.kubelet.view().borrow().register_calls, 0);
    for filler in fillers {
        std::fs::remove_file(filler).unwrap();
    }
    h.registered().await;
    let (status, _) = h.terminate_plugin();
    assert!(status.success());
}

#[tokio::test]
async fn the_pci_strategy_advertises_addresses_and_refuses_ibdev_names() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--device-id-strategy", "pci"]);
    let view = h.registered().await;
    assert_eq!(
        ids(&view),
        [
            "0000:10:1b.0",
            "0000:20:1b.0",
            "0000:90:1b.0",
            "0000:a0:1b.0"
        ]
    );
    assert_eq!(view.numa_of("0000:90:1b.0"), Some(1));
    let answer = h.allocate(&[&["0000:20:1b.0"]]).await.unwrap();
    let efa = h.efas()[1].clone();
    assert_eq!(
        answer.container_responses[0].devices[0].container_path,
        format!("/dev/infiniband/{}", efa.uverbs_name())
    );
    let err = h.allocate(&[&["rdmap32s27"]]).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("rdmap32s27"), "{}", err.message());
}
