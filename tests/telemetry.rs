//! The HTTP endpoint of the real binary: metrics, probes and pod attribution follow what the
//! kubelet and the node do.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape};
use support::{Harness, sample};

fn hw(name: &str, device: &FakeDevice) -> String {
    format!(
        "efa_{name}_total{{device=\"{}\",ibdev=\"{}\"}}",
        device.ibdev, device.ibdev
    )
}

fn devices(text: &str, health: &str) -> Option<f64> {
    sample(
        text,
        &format!("efa_device_plugin_devices{{health=\"{health}\"}}"),
    )
}

/// Scrapes until the registration and kubelet-restart counters reach these values.
async fn registrations(h: &Harness, registrations: u64, restarts: u64) -> String {
    let what = format!("{registrations} registrations and {restarts} kubelet restarts");
    h.scrape_until(&what, |t| {
        sample(t, "efa_device_plugin_registrations_total") == Some(registrations as f64)
            && sample(t, "efa_device_plugin_kubelet_restarts_total") == Some(restarts as f64)
    })
    .await
}

#[tokio::test]
async fn metrics_follow_registrations_restarts_allocations_and_failures() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();

    let text = registrations(&h, 1, 0).await;
    assert_eq!(devices(&text, "healthy"), Some(4.0), "{text}");
    assert_eq!(devices(&text, "unhealthy"), Some(0.0));
    assert_eq!(
        sample(&text, "efa_device_plugin_kubelet_restarts_total"),
        Some(0.0)
    );
    assert_eq!(sample(&text, "efa_device_plugin_dra_conflict"), Some(0.0));
    let build = format!(
        "efa_device_plugin_build_info{{version=\"{}\"}}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(sample(&text, &build), Some(1.0));
    assert!(text.contains("# TYPE efa_device_plugin_allocate_duration_seconds histogram"));
    for efa in &efas {
        assert_eq!(sample(&text, &hw("tx_bytes", efa)), Some(0.0), "{text}");
        assert_eq!(sample(&text, &hw("submitted_cmds", efa)), Some(0.0));
    }
    assert!(!text.contains("lifespan"));

    // Counters are read when scraped, never cached.
    h.node
        .set_port_counter(&efas[2], "tx_bytes", 987_654_321)
        .unwrap();
    let text = h.get("/metrics").await.1;
    assert_eq!(
        sample(&text, &hw("tx_bytes", &efas[2])),
        Some(987_654_321.0)
    );

    h.allocate(&[&[&efas[0].ibdev]]).await.unwrap();
    h.allocate(&[&["0000:ff:00.0"]]).await.unwrap_err();
    let text = h.get("/metrics").await.1;
    let ok = "efa_device_plugin_allocations_total{result=\"ok\"}";
    let error = "efa_device_plugin_allocations_total{result=\"error\"}";
    assert_eq!(sample(&text, ok), Some(1.0), "{text}");
    assert_eq!(sample(&text, error), Some(1.0));
    assert_eq!(
        sample(&text, "efa_device_plugin_allocate_duration_seconds_count"),
        Some(2.0)
    );

    h.kubelet.restart().await.unwrap();
    h.registered().await;
    registrations(&h, 2, 1).await;

    let started = h.kubelet.view().borrow().streams_started;
    h.kubelet.end_stream();
    h.wait("registration after the stream end", |v| {
        v.streams_started > started && v.stream_open
    })
    .await;
    // A stream end is not a kubelet restart.
    registrations(&h, 3, 1).await;

    let device_healthy = |t: &str, efa: &FakeDevice| {
        let series = format!(
            "efa_device_plugin_device_healthy{{device=\"{}\",ibdev=\"{}\"}}",
            efa.ibdev, efa.ibdev
        );
        sample(t, &series)
    };
    h.node.remove_node(&efas[1]).unwrap();
    let text = h
        .scrape_until("the failed device", |t| {
            devices(t, "unhealthy") == Some(1.0) && devices(t, "healthy") == Some(3.0)
        })
        .await;
    // The one that failed is named, so an alert can say which.
    assert_eq!(device_healthy(&text, &efas[1]), Some(0.0), "{text}");
    assert_eq!(device_healthy(&text, &efas[0]), Some(1.0), "{text}");
    h.node.create_node(&efas[1]).unwrap();
    h.scrape_until("the recovery", |t| {
        devices(t, "healthy") == Some(4.0) && device_healthy(t, &efas[1]) == Some(1.0)
    })
    .await;
}

/// Every shape's counters reach `/metrics` under their sysfs names, including the ones only
/// Nitro v4 and later show, and the device gauge counts its EFAs.
#[tokio::test]
async fn every_shape_exports_each_counter_its_efas_show() {
    for shape in Shape::ALL {
        let mut h = Harness::new(shape);
        h.spawn_plugin(&[]);
        h.wait("an open stream", |v| v.stream_open && v.snapshots > 0)
            .await;
        let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
        let healthy = efas.len() as f64;
        let text = h
            .scrape_until("every EFA healthy", |t| {
                devices(t, "healthy") == Some(healthy)
            })
            .await;
        for efa in &efas {
            for counter in efa.counters() {
                assert_eq!(
                    sample(&text, &hw(counter, efa)),
                    Some(0.0),
                    "{shape:?} {} {counter}",
                    efa.ibdev
                );
            }
        }
        let newer = efas.iter().any(|e| e.nitro_v4);
        assert_eq!(
            text.contains("efa_impaired_remote_conn_events_total{"),
            newer,
            "{shape:?}"
        );
    }
}

#[tokio::test]
async fn probes_follow_the_registration() {
    let mut h = Harness::new(Shape::P4d);
    // A device-plugin dir without a kubelet: alive, but not ready.
    let lonely = h.root.path().join("no-kubelet");
    h.spawn_plugin(&["--device-plugin-dir", &lonely.display().to_string()]);
    assert_eq!(h.get("/healthz").await, (200, "ok\n".into()));
    let (status, reason) = h.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(reason.contains("not registered"), "{reason}");
    assert_eq!(h.get("/nope").await.0, 404);
    let registered = |t: &str| sample(t, "efa_device_plugin_registered");
    assert_eq!(registered(&h.get("/metrics").await.1), Some(0.0));
    h.terminate_plugin();

    h.spawn_plugin(&[]);
    h.registered().await;
    wait_ready(&h, 200).await;
    assert_eq!(h.get("/healthz").await.0, 200);
    h.scrape_until("the registration gauge", |t| registered(t) == Some(1.0))
        .await;

    // The kubelet's restart drops the registration until the plugin is back.
    h.kubelet.restart().await.unwrap();
    h.registered().await;
    wait_ready(&h, 200).await;
}

async fn wait_ready(h: &Harness, expected: u16) {
    let deadline = Instant::now() + support::TIMEOUT;
    loop {
        let (status, body) = h.get("/readyz").await;
        if status == expected {
            return;
        }
        assert!(Instant::now() < deadline, "/readyz stayed {status}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The info series naming `pod` as a holder of `device`.
fn allocation(device: &FakeDevice, pod: &str) -> String {
    format!(
        "efa_device_allocation{{device=\"{}\",namespace=\"ml\",pod=\"{pod}\",container=\"main\"}}",
        device.ibdev
    )
}

#[tokio::test]
async fn an_info_series_names_each_container_that_holds_a_device() {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let socket: PathBuf = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = PodResourcesStub::start(
        &socket,
        vec![
            pod(
                "ml",
                "trainer-0",
                "main",
                "vpc.amazonaws.com/efa",
                &[&efas[0].ibdev],
            ),
            pod(
                "ml",
                "gpu-only",
                "main",
                "nvidia.com/gpu",
                &[&efas[1].ibdev],
            ),
            pod(
                "ml",
                "sharer",
                "main",
                "vpc.amazonaws.com/efa",
                &[&efas[2].ibdev],
            ),
            pod(
                "ml",
                "other",
                "main",
                "vpc.amazonaws.com/efa",
                &[&efas[2].ibdev],
            ),
        ],
    )
    .unwrap();
    h.spawn_plugin(&["--pod-resources-socket", &socket.display().to_string()]);
    h.registered().await;
    h.node.set_port_counter(&efas[0], "rx_bytes", 4096).unwrap();

    let held = allocation(&efas[0], "trainer-0");
    let text = h
        .scrape_until("the allocations", |t| sample(t, &held).is_some())
        .await;
    assert_eq!(sample(&text, &held), Some(1.0), "{text}");
    // A shared device has one series per holder, and its counters one series in all.
    assert_eq!(sample(&text, &allocation(&efas[2], "sharer")), Some(1.0));
    assert_eq!(sample(&text, &allocation(&efas[2], "other")), Some(1.0));
    assert_eq!(text.matches("efa_device_allocation{").count(), 3, "{text}");
    assert!(text.contains("# TYPE efa_device_allocation gauge"));
    assert_eq!(sample(&text, &hw("rx_bytes", &efas[0])), Some(4096.0));
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("efa_rx_bytes_total{"))
            .count(),
        4,
        "one series per device, whoever holds it"
    );
    assert!(
        !text.contains("gpu-only"),
        "another resource's pod is not ours"
    );

    // A kubelet that does not answer never costs the scrape: scrapes do not wait on the
    // kubelet. Once a poll has timed out, its last answer stays, marked stale.
    kubelet.stall();
    let started = Instant::now();
    let (status, _) = h.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    let text = h
        .scrape_until("the view marked stale", |t| {
            sample(t, "efa_device_plugin_pod_resources_stale") == Some(1.0)
        })
        .await;
    assert_eq!(sample(&text, &held), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, &hw("rx_bytes", &efas[0])),
        Some(4096.0),
        "{text}"
    );
}

#[tokio::test]
async fn pod_attribution_can_be_turned_off() {
    let mut h = Harness::new(Shape::P4d);
    let efa = h.efas()[0].clone();
    let socket: PathBuf = h.root.path().join("pod-resources/kubelet.sock");
    let _kubelet = PodResourcesStub::start(
        &socket,
        vec![pod(
            "ml",
            "trainer-0",
            "main",
            "vpc.amazonaws.com/efa",
            &[&efa.ibdev],
        )],
    )
    .unwrap();
    h.spawn_plugin(&[
        "--pod-resources-socket",
        &socket.display().to_string(),
        "--counter-pod-labels=false",
    ]);
    h.registered().await;
    // The same stand-in is named in the first scrape when attribution is on.
    for _ in 0..3 {
        let text = h
            .scrape_until("the counters", |t| {
                sample(t, &hw("rx_bytes", &efa)).is_some()
            })
            .await;
        assert!(!text.contains("efa_device_allocation"), "{text}");
        assert!(!text.contains("trainer-0"), "{text}");
    }
}

/// The JSON log lines whose message is `message`.
fn logged(h: &Harness, message: &str) -> Vec<serde_json::Value> {
    h.plugin_log()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .filter(|line: &serde_json::Value| line["message"] == message)
        .collect()
}

#[tokio::test]
async fn logs_each_change_once_and_nothing_while_idle() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered_and_logged().await;
    let efa = h.efas()[1].clone();

    // Scrapes, probes and several rescans and guard checks: none of it is news.
    let before = h.plugin_log().lines().count();
    for path in ["/metrics", "/healthz", "/readyz", "/metrics"] {
        assert_eq!(h.get(path).await.0, 200);
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(h.plugin_log().lines().count(), before, "{}", h.plugin_log());

    h.node.remove_node(&efa).unwrap();
    h.wait("the failure", |v| v.healthy() == 3).await;
    h.node.create_node(&efa).unwrap();
    h.wait("the recovery", |v| v.healthy() == 4).await;
    h.kubelet.restart().await.unwrap();
    h.registered().await;
    // Let further rescans pass: a change stays logged once.
    tokio::time::sleep(Duration::from_millis(600)).await;

    for message in ["device unhealthy", "device healthy again"] {
        let lines = logged(&h, message);
        assert_eq!(lines.len(), 1, "{message}\n{}", h.plugin_log());
        assert_eq!(lines[0]["device"], efa.ibdev.as_str());
        assert_eq!(lines[0]["ibdev"], efa.ibdev.as_str());
    }
    let registrations = logged(&h, "registered with the kubelet");
    assert_eq!(registrations.len(), 2, "{}", h.plugin_log());
    assert_eq!(registrations[1]["kubelet_restarted"], true);
}

#[test]
fn the_metrics_address_is_checked_configurable_and_can_be_off() {
    let (code, _, stderr) = support::run_binary(&["--metrics-address", "localhost:9465"], &[]);
    assert_ne!(code, 0);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--metrics-address"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "metrics-address: 127.0.0.1:19465\n").unwrap();
    let config = config.display().to_string();
    let effective = |env: &[(&str, &str)]| {
        let (code, stdout, stderr) = support::run_binary(&["--config", &config, "config"], env);
        assert_eq!(code, 0, "{stderr}");
        let yaml: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        yaml["metrics-address"].as_str().unwrap().to_owned()
    };
    assert_eq!(effective(&[]), "127.0.0.1:19465");
    assert_eq!(
        effective(&[("EFA_DP_METRICS_ADDRESS", "")]),
        "",
        "empty disables"
    );
}

#[tokio::test]
async fn the_nfd_feature_file_follows_the_devices_and_goes_with_the_plugin() {
    let mut h = Harness::new(Shape::P5);
    let file = h.root.path().join("features.d/efa");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    h.spawn_plugin(&["--nfd-features-file", &file.display().to_string()]);
    h.registered().await;
    let text = std::fs::read_to_string(&file).unwrap();
    for line in [
        "efa.count=32",
        "efa.numa-nodes=0_1",
        "efa.device-model=efa2",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from\n{text}"
        );
    }
    let (status, took) = h.terminate_plugin();
    assert!(status.success(), "{}", h.plugin_log());
    assert!(took < Duration::from_secs(2));
    assert!(!file.exists(), "the labels must go with the plugin");
}

#[tokio::test]
async fn the_exclusive_rdma_netns_mode_is_logged_once_with_the_fix_and_shown_as_a_gauge() {
    let mut h = Harness::new(Shape::NoEfa);
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered().await;
    let gauge = |t: &str| sample(t, "efa_device_plugin_rdma_netns_exclusive");
    let text = h
        .scrape_until("the netns gauge", |t| gauge(t).is_some())
        .await;
    assert_eq!(gauge(&text), Some(0.0), "present, 0, from the start");

    h.node.set_rdma_netns_mode(Some("N")).unwrap();
    h.scrape_until("exclusive mode", |t| gauge(t) == Some(1.0))
        .await;
    // Several more rescans: the cause is logged once while it lasts.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let errors: Vec<serde_json::Value> = h
        .plugin_log()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .filter(|line: &serde_json::Value| line["level"] == "ERROR")
        .collect();
    assert_eq!(errors.len(), 1, "{}", h.plugin_log());
    let message = errors[0]["message"].as_str().unwrap();
    for part in [
        "exclusive",
        "netns_mode=N",
        "rdma system set netns shared",
        "hostNetwork",
    ] {
        assert!(message.contains(part), "{part}: {message}");
    }

    // A node without ib_core's parameter is in the shared mode.
    h.node.set_rdma_netns_mode(None).unwrap();
    h.scrape_until("shared mode again", |t| gauge(t) == Some(0.0))
        .await;
}

const EFA: &str = "vpc.amazonaws.com/efa";
const DOUBLE_BOOKED: &str = "efa_device_plugin_double_booked_devices";
const DOUBLE_BOOKED_LOG: &str = "an EFA is double-booked";

/// Serves `pods` as the kubelet's answer until the plugin has read it in two polls, the number a
/// double booking needs to count; then the gauge.
async fn double_booked_after(
    h: &Harness,
    kubelet: &PodResourcesStub,
    pods: Vec<efa_device_plugin::proto::podresources::PodResources>,
) -> Option<f64> {
    kubelet.serve(pods);
    // A List answered just after `serve` may have read the answer before it.
    let read = kubelet.lists() + 3;
    support::eventually("three more polls", || kubelet.lists() >= read).await;
    let (_, text) = h.get("/metrics").await;
    sample(&text, DOUBLE_BOOKED)
}

/// What the kubelet's PodResources `List` answers through a pod's life, as docs/operations.md
/// (#double-bookings) reads it from the kubelet's code, never counts as a double booking; two
/// pods that both hold one EFA do, with one warning naming both, and again when it comes back.
#[tokio::test]
async fn double_bookings_count_and_the_kubelets_ordinary_answers_do_not() {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<String> = h.efas().iter().map(|d| d.ibdev.clone()).collect();
    let socket: PathBuf = h.root.path().join("pod-resources/kubelet.sock");
    let kubelet = PodResourcesStub::start(&socket, vec![]).unwrap();
    h.spawn_plugin(&["--pod-resources-socket", &socket.display().to_string()]);
    h.registered().await;
    let text = h
        .scrape_until("the gauge", |t| sample(t, DOUBLE_BOOKED).is_some())
        .await;
    assert_eq!(
        sample(&text, DOUBLE_BOOKED),
        Some(0.0),
        "present from the start"
    );

    let holds = |name: &str, container: &str, efa: &str| pod("ml", name, container, EFA, &[efa]);
    // A Job's pod runs with the first EFA, its container restarted: a restart keeps the
    // container's devices and adds no holder, so the answer stays the same.
    let job = || holds("job-1", "main", &efas[0]);
    assert_eq!(
        double_booked_after(&h, &kubelet, vec![job()]).await,
        Some(0.0)
    );
    // The Job completes and a new pod gets its EFA. With KubeletPodResourcesListUseActivePods
    // (on by default since 1.34) the completed pod is not listed at all ...
    let next = || holds("next", "main", &efas[0]);
    assert_eq!(
        double_booked_after(&h, &kubelet, vec![next()]).await,
        Some(0.0)
    );
    // ... without it, it is listed, with its devices already freed: List frees the devices of
    // pods no longer active before reading any.
    let completed = pod("ml", "job-1", "main", EFA, &[]);
    assert_eq!(
        double_booked_after(&h, &kubelet, vec![completed, next()]).await,
        Some(0.0)
    );
    // A deleted pod still terminating is active: listed with its EFA, which no other pod can
    // have until it has terminated.
    let terminating = || holds("deleted", "main", &efas[1]);
    assert_eq!(
        double_booked_after(
            &h,
            &kubelet,
            vec![next(), terminating(), holds("new", "main", &efas[2])]
        )
        .await,
        Some(0.0)
    );
    // Containers of one pod: a restartable init container next to an app container.
    let mut sidecar = holds("sidecar", "init", &efas[3]);
    sidecar
        .containers
        .extend(holds("sidecar", "main", &efas[3]).containers);
    assert_eq!(
        double_booked_after(&h, &kubelet, vec![next(), sidecar]).await,
        Some(0.0)
    );
    assert!(
        !h.plugin_log().contains(DOUBLE_BOOKED_LOG),
        "{}",
        h.plugin_log()
    );

    // The kubelet gives the first EFA to a second pod, once under its PCI address.
    let pci = h.efas()[0].bdf.clone();
    let booked = || vec![next(), holds("twin", "main", &pci)];
    assert_eq!(double_booked_after(&h, &kubelet, booked()).await, Some(1.0));
    assert_eq!(double_booked_after(&h, &kubelet, booked()).await, Some(1.0));
    let log = h.plugin_log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(DOUBLE_BOOKED_LOG))
        .collect();
    assert_eq!(warnings.len(), 1, "once while it lasts: {log}");
    for name in [efas[0].as_str(), "ml/next", "ml/twin"] {
        assert!(warnings[0].contains(name), "{name} in {}", warnings[0]);
    }
    // It ends, and comes back: warned of again.
    assert_eq!(
        double_booked_after(&h, &kubelet, vec![next()]).await,
        Some(0.0)
    );
    assert_eq!(double_booked_after(&h, &kubelet, booked()).await, Some(1.0));
    let again = h.plugin_log().matches(DOUBLE_BOOKED_LOG).count();
    assert_eq!(again, 2, "{}", h.plugin_log());
}

#[tokio::test]
async fn a_missing_pod_resources_socket_is_logged_once_and_shown_until_it_answers() {
    let mut h = Harness::new(Shape::P4d);
    let efa = h.efas()[0].clone();
    let socket: PathBuf = h.root.path().join("pod-resources-typo/kubelet.sock");
    h.spawn_plugin(&[
        "--pod-resources-socket",
        &socket.display().to_string(),
        "--log-format",
        "json",
    ]);
    h.registered().await;
    let text = h
        .scrape_until("the view shown unknown", |t| {
            sample(t, "efa_device_plugin_pod_resources_unknown") == Some(1.0)
        })
        .await;
    assert_eq!(
        sample(&text, "efa_device_plugin_pod_resources_stale"),
        Some(0.0),
        "nothing is kept, so nothing is stale: {text}"
    );
    // Several polls go by, one line says it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let said = logged(
        &h,
        "cannot list pod resources; a view the kubelet gave is kept, stale, and after 5 minutes its holders are kept as unknown; without one, who holds which EFA is unknown until it answers",
    );
    assert_eq!(said.len(), 1, "{}", h.plugin_log());
    assert_eq!(said[0]["socket"], socket.display().to_string());
    assert!(
        said[0]["error"]
            .as_str()
            .unwrap()
            .contains("no such socket"),
        "{said:?}"
    );

    let _kubelet = PodResourcesStub::start(
        &socket,
        vec![pod(
            "ml",
            "trainer-0",
            "main",
            "vpc.amazonaws.com/efa",
            &[&efa.ibdev],
        )],
    )
    .unwrap();
    let text = h
        .scrape_until("the view known", |t| {
            sample(t, "efa_device_plugin_pod_resources_unknown") == Some(0.0)
        })
        .await;
    assert_eq!(sample(&text, &allocation(&efa, "trainer-0")), Some(1.0));
}
