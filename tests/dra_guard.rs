//! The DRA-conflict guard of the real binary: a DRA driver's registration socket withholds every
//! EFA, its removal gives them back, and `--allow-dra-coexistence` turns the guard off.

mod support;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, sample};
use tonic::Code;

fn registry(h: &Harness) -> PathBuf {
    let dir = h.root.path().join("plugins_registry");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What DRANET leaves in the kubelet's plugins_registry while it runs.
fn register_dranet(h: &Harness) -> (UnixListener, PathBuf) {
    let socket = registry(h).join("dra.net-reg.sock");
    (UnixListener::bind(&socket).unwrap(), socket)
}

/// The conflict gauge, labelled with the driver while there is one.
fn conflict(text: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix("efa_device_plugin_dra_conflict")?;
        let value = rest.strip_prefix(' ').or_else(|| {
            rest.strip_prefix("{driver=\"")?
                .split_once("\"} ")
                .map(|(_, value)| value)
        })?;
        value.trim().parse().ok()
    })
}

#[tokio::test]
async fn a_registered_dra_driver_withholds_every_device_until_it_goes() {
    let mut h = Harness::new(Shape::P4d);
    // Another driver's registration is no conflict.
    let _gpu = UnixListener::bind(registry(&h).join("gpu.nvidia.com-reg.sock")).unwrap();
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered().await;
    let id = h.efas()[0].ibdev.clone();

    let (_dranet, socket) = register_dranet(&h);
    let view = h
        .wait("every device withheld", |v| {
            v.healthy() == 0 && v.devices.len() == 4
        })
        .await;
    assert!(view.stream_open, "capacity stays advertised");
    let text = h
        .scrape_until("the conflict metric", |t| conflict(t) == Some(1.0))
        .await;
    assert_eq!(
        sample(&text, "efa_device_plugin_devices{health=\"unhealthy\"}"),
        Some(4.0)
    );
    let refused = h.allocate(&[&[&id]]).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("dra.net"),
        "{}",
        refused.message()
    );

    std::fs::remove_file(&socket).unwrap();
    h.wait("devices back", |v| v.healthy() == 4).await;
    h.scrape_until("the conflict's end", |t| conflict(t) == Some(0.0))
        .await;

    let log = h.plugin_log();
    let starts = log.matches("every EFA is withheld from allocation").count();
    assert_eq!(starts, 1, "the start is logged once\n{log}");
    let ends = log.matches("devices are advertised again").count();
    assert_eq!(ends, 1, "the end is logged once\n{log}");
    let line = log.lines().find(|l| l.contains("withheld")).unwrap();
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(line["level"], "ERROR");
    assert!(
        line["conflict"]
            .as_str()
            .unwrap()
            .contains("dra.net-reg.sock")
    );
}

fn held_devices(text: &str) -> Option<f64> {
    sample(text, "efa_device_plugin_dra_conflict_held_devices")
}

/// The unsafe handoff: a DRA driver registers while pods still hold EFAs through the plugin.
#[tokio::test]
async fn pods_holding_efas_when_a_driver_registers_are_warned_of_once_and_counted() {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<String> = h.efas().iter().map(|d| d.ibdev.clone()).collect();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _kubelet = PodResourcesStub::start(
        &socket,
        vec![
            pod("ml", "p1", "main", "vpc.amazonaws.com/efa", &[&efas[0]]),
            pod("ml", "p1", "side", "vpc.amazonaws.com/efa", &[&efas[1]]),
            pod("ml", "p3", "main", "vpc.amazonaws.com/efa", &[&efas[2]]),
            pod("ml", "gpu", "main", "nvidia.com/gpu", &[&efas[3]]),
        ],
    )
    .unwrap();
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered().await;
    let text = h
        .scrape_until("the gauge", |t| held_devices(t).is_some())
        .await;
    assert_eq!(held_devices(&text), Some(0.0), "no driver, nothing unseen");

    let (dranet, registration) = register_dranet(&h);
    let text = h
        .scrape_until("3 EFAs held through the plugin", |t| {
            held_devices(t) == Some(3.0)
        })
        .await;
    assert_eq!(conflict(&text), Some(1.0));
    // Several polls of an unchanged view add no warning.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let warnings = |log: &str| -> Vec<serde_json::Value> {
        log.lines()
            .filter(|l| l.contains("while an EFA DRA driver is registered"))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let log = h.plugin_log();
    let warned = warnings(&log);
    let pods: Vec<(&str, &str)> = warned
        .iter()
        .map(|w| (w["pod"].as_str().unwrap(), w["ids"].as_str().unwrap()))
        .collect();
    let p1_ids = format!("{},{}", efas[0], efas[1]);
    assert_eq!(
        pods,
        [("p1", p1_ids.as_str()), ("p3", efas[2].as_str())],
        "{log}"
    );
    assert!(warned.iter().all(|w| w["level"] == "WARN"));
    // The guard's own line names the driver and what decides whether DRA takes over.
    let line = log.lines().find(|l| l.contains("withheld")).unwrap();
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    let reason = line["conflict"].as_str().unwrap();
    assert!(
        reason.contains("DRA driver dra.net")
            && reason.contains("spec.extendedResourceName is vpc.amazonaws.com/efa")
            && reason.contains("kubectl get deviceclasses"),
        "{reason}"
    );

    drop(dranet);
    std::fs::remove_file(&registration).unwrap();
    h.scrape_until("nothing unseen without the driver", |t| {
        held_devices(t) == Some(0.0) && conflict(t) == Some(0.0)
    })
    .await;
    // Long enough for the view to see the end, so a second conflict warns of the pods again.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let _again = register_dranet(&h);
    h.scrape_until("the second conflict", |t| held_devices(t) == Some(3.0))
        .await;
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(warnings(&h.plugin_log()).len(), 4, "{}", h.plugin_log());
}

#[tokio::test]
async fn a_driver_present_at_start_means_no_device_is_ever_allocatable() {
    let mut h = Harness::new(Shape::P4d);
    let (_dranet, _) = register_dranet(&h);
    h.spawn_plugin(&[]);
    let view = h.registered().await;
    assert_eq!(view.healthy(), 0);
    assert_eq!(
        view.snapshots, 1,
        "the first snapshot already withheld them"
    );
}

#[tokio::test]
async fn a_driver_whose_name_only_starts_like_a_listed_one_is_no_conflict() {
    let mut h = Harness::new(Shape::P4d);
    let _netapp = UnixListener::bind(registry(&h).join("dra.netapp.io-reg.sock")).unwrap();
    h.spawn_plugin(&[]);
    assert_eq!(h.registered().await.healthy(), 4);
    assert_eq!(conflict(&h.get("/metrics").await.1), Some(0.0));

    // DRANET's own names, with and without the DRA helper's rolling-update part, still count.
    for name in ["dra.net.sock", "dra.net-3f2a9c1e-reg.sock"] {
        let socket = registry(&h).join(name);
        let listener = UnixListener::bind(&socket).unwrap();
        h.wait(name, |v| v.devices.len() == 4 && v.healthy() == 0)
            .await;
        drop(listener);
        std::fs::remove_file(&socket).unwrap();
        h.wait("the devices back", |v| v.healthy() == 4).await;
    }
}

#[tokio::test]
async fn coexistence_can_be_allowed_and_the_driver_list_configured() {
    let mut h = Harness::new(Shape::P4d);
    let (_dranet, _) = register_dranet(&h);
    h.spawn_plugin(&["--allow-dra-coexistence"]);
    assert_eq!(h.registered().await.healthy(), 4);
    let text = h.get("/metrics").await.1;
    assert_eq!(conflict(&text), Some(0.0));
    h.terminate_plugin();

    let _other = UnixListener::bind(registry(&h).join("efa.example.com-reg.sock")).unwrap();
    h.spawn_plugin(&["--dra-drivers", "efa.example.com"]);
    h.wait("the configured driver's conflict", |v| {
        v.stream_open && v.devices.len() == 4 && v.healthy() == 0
    })
    .await;
}

#[test]
fn the_driver_list_and_the_override_come_from_flags_env_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "dra-drivers: [dra.net, efa.example.com]\nallow-dra-coexistence: true\n",
    )
    .unwrap();
    let config = config.display().to_string();
    let effective = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = vec!["--config", &config];
        all.extend(args);
        all.push("config");
        let (code, stdout, stderr) = support::run_binary(&all, env);
        assert_eq!(code, 0, "{stderr}");
        serde_yaml::from_str::<serde_yaml::Value>(&stdout).unwrap()
    };
    let from_file = effective(&[], &[]);
    assert_eq!(from_file["dra-drivers"][1], "efa.example.com");
    assert_eq!(from_file["allow-dra-coexistence"], true);
    let from_env = effective(
        &[],
        &[
            ("EFA_DP_DRA_DRIVERS", "a.example, b.example"),
            ("EFA_DP_ALLOW_DRA_COEXISTENCE", "false"),
        ],
    );
    assert_eq!(from_env["dra-drivers"][0], "a.example");
    assert_eq!(from_env["dra-drivers"][1], "b.example");
    assert_eq!(from_env["allow-dra-coexistence"], false);

    let (code, _, stderr) = support::run_binary(&["--dra-drivers", "dra.net/efa"], &[]);
    assert_ne!(code, 0);
    assert!(stderr.contains("--dra-drivers"), "{stderr}");
}

/// CPU time (user + system, in clock ticks) the process has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test]
async fn the_registry_dir_may_come_and_go() {
    let mut h = Harness::new(Shape::P4d);
    let pid = h.spawn_plugin(&[]);
    h.registered().await;
    let (_dranet, _) = register_dranet(&h);
    h.wait("the conflict in a late dir", |v| v.healthy() == 0)
        .await;
    std::fs::remove_dir_all(registry(&h)).unwrap();
    h.wait("the conflict's end with its dir", |v| v.healthy() == 4)
        .await;

    // With the dir gone the guard falls back to its periodic look, and idles.
    let before = cpu_ticks(pid);
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let used = cpu_ticks(pid) - before;
    assert!(used < 20, "{used} ticks in one idle second");
    let (_again, _) = register_dranet(&h);
    h.wait("the conflict in the recreated dir", |v| v.healthy() == 0)
        .await;
}

/// AWS's networking DRA driver (`dra.networking.k8s.aws`) serves EFAs as well as RoCE and ENA,
/// picked per device by `dra.vpc.amazonaws.com/deviceType`; the plugin cannot read its
/// ResourceSlices, so by default its registration withholds every EFA, as DRANET's does, and
/// the log, the refusal and `list` name it.
#[tokio::test]
async fn aws_networking_dra_driver_is_watched_by_default_and_named() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered().await;
    let id = h.efas()[0].ibdev.clone();

    // The name the DRA helper library gives the driver's registration socket.
    let socket = registry(&h).join("dra.networking.k8s.aws-reg.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    h.wait("every device withheld", |v| {
        v.healthy() == 0 && v.devices.len() == 4
    })
    .await;
    let text = h
        .scrape_until("the conflict metric", |t| conflict(t) == Some(1.0))
        .await;
    assert_eq!(
        sample(
            &text,
            "efa_device_plugin_dra_conflict{driver=\"dra.networking.k8s.aws\"}"
        ),
        Some(1.0),
        "the gauge names the driver"
    );
    let refused = h.allocate(&[&[&id]]).await.unwrap_err();
    assert!(
        refused
            .message()
            .contains("DRA driver dra.networking.k8s.aws"),
        "{}",
        refused.message()
    );
    let log = h.plugin_log();
    assert!(
        log.contains("dra.networking.k8s.aws-reg.sock")
            && log.contains("\"driver\":\"dra.networking.k8s.aws\""),
        "the log names the driver and its socket\n{log}"
    );

    let mut args = support::node_args(&h.node);
    args.extend([
        "--plugins-registry-dir".to_owned(),
        registry(&h).display().to_string(),
        "list".to_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, stdout, stderr) = support::run_binary(&args, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.starts_with("warning: DRA driver dra.networking.k8s.aws is registered"),
        "{stderr}"
    );
    assert_eq!(stdout.matches("Unhealthy").count(), 4, "{stdout}");

    drop(listener);
    std::fs::remove_file(&socket).unwrap();
    h.wait("devices back", |v| v.healthy() == 4).await;

    // Where it serves only RoCE or ENA, an operator drops it from the list.
    let mut h = Harness::new(Shape::P4d);
    let _listener =
        UnixListener::bind(registry(&h).join("dra.networking.k8s.aws-reg.sock")).unwrap();
    h.spawn_plugin(&["--dra-drivers", "dra.net"]);
    assert_eq!(h.registered().await.healthy(), 4);
}
