//! The cdi device-list strategy and allocate.env against the real binary: what Allocate answers
//! in either mode, and the CDI spec file's whole life (written, rewritten, retried, kept or
//! removed on exit).

mod support;

use std::path::PathBuf;

use efa_device_plugin::proto::podresources::PodResources;
use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::{self, Shape};
use support::{Harness, assert_one_line_error, eventually, run_binary, sample, write_config};

const SPEC_FILE: &str = "vpc.amazonaws.com-efa.json";
const FAILURES: &str = "efa_device_plugin_cdi_spec_write_failures_total";
const RESOURCE: &str = "vpc.amazonaws.com/efa";

fn spec_dir(h: &Harness) -> PathBuf {
    h.root.path().join("cdi")
}

/// Starts the plugin in cdi mode with its spec dir in the harness, plus `extra` flags.
async fn cdi_plugin(shape: Shape, extra: &[&str]) -> Harness {
    let mut h = Harness::new(shape);
    let dir = spec_dir(&h).display().to_string();
    let mut args = vec!["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir];
    args.extend_from_slice(extra);
    h.spawn_plugin(&args);
    h.wait("registration", |v| v.stream_open && !v.devices.is_empty())
        .await;
    h
}

fn read_spec(h: &Harness) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(spec_dir(h).join(SPEC_FILE)).ok()?;
    Some(serde_json::from_str(&text).expect("the spec is JSON"))
}

fn spec_names(spec: &serde_json::Value) -> Vec<String> {
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn cdi_mode_answers_qualified_names_and_no_device_specs() {
    let h = cdi_plugin(Shape::P4d, &["--allocate-env", "FI_PROVIDER=efa"]).await;
    let response = h
        .allocate(&[&["rdmap16s27", "rdmap144s27"], &["rdmap160s27"]])
        .await
        .unwrap();
    let names: Vec<Vec<&str>> = response
        .container_responses
        .iter()
        .map(|c| c.cdi_devices.iter().map(|d| d.name.as_str()).collect())
        .collect();
    assert_eq!(
        names,
        [
            vec![
                "vpc.amazonaws.com/efa=rdmap16s27",
                "vpc.amazonaws.com/efa=rdmap144s27"
            ],
            vec!["vpc.amazonaws.com/efa=rdmap160s27"],
        ]
    );
    for container in &response.container_responses {
        assert!(
            container.devices.is_empty(),
            "no DeviceSpecs: {container:?}"
        );
        assert!(container.mounts.is_empty() && container.annotations.is_empty());
        // The spec's container edits carry the env too (checked below).
        assert_eq!(
            container.envs,
            std::collections::HashMap::from([("FI_PROVIDER".to_string(), "efa".to_string())]),
            "{container:?}"
        );
    }
    let spec = read_spec(&h).expect("spec written");
    assert_eq!(spec["kind"], "vpc.amazonaws.com/efa");
    assert_eq!(
        spec["containerEdits"]["env"],
        serde_json::json!(["FI_PROVIDER=efa"])
    );
    let efa = h.efas()[0].clone();
    let first = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == efa.ibdev.as_str())
        .expect("the first EFA in the spec, under its ibdev name");
    let node = &first["containerEdits"]["deviceNodes"][0];
    assert_eq!(
        node["path"],
        format!("/dev/infiniband/{}", efa.uverbs_name())
    );
    assert_eq!(node["type"], "c");
    assert_eq!(node["major"], efa.dev.major);
    assert_eq!(node["minor"], efa.dev.minor);
    assert_eq!(node["permissions"], "rw");
}

/// Values with commas and `=` reach the spec and the Allocate answer whole, from repeated flags
/// and from the variable's map alike.
#[tokio::test]
async fn env_values_with_commas_survive_the_flag_and_the_variable() {
    let expected = ["NCCL_SOCKET_IFNAME=^lo,docker", "OPTS=a=1,b=2"];
    let from_flags = cdi_plugin(
        Shape::P4d,
        &[
            "--allocate-env",
            "OPTS=a=1,b=2",
            "--allocate-env",
            "NCCL_SOCKET_IFNAME=^lo,docker",
        ],
    )
    .await;
    let mut from_variable = Harness::new(Shape::P4d);
    let dir = spec_dir(&from_variable).display().to_string();
    from_variable.spawn_plugin_with(
        &["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir],
        |command| {
            command.env(
                "EFA_DP_ALLOCATE_ENV",
                r#"{"OPTS": "a=1,b=2", "NCCL_SOCKET_IFNAME": "^lo,docker"}"#,
            );
        },
    );
    from_variable.registered().await;
    for h in [&from_flags, &from_variable] {
        eventually("the spec", || read_spec(h).is_some()).await;
        let spec = read_spec(h).unwrap();
        assert_eq!(spec["containerEdits"]["env"], serde_json::json!(expected));
        let response = h.allocate(&[&["rdmap16s27"]]).await.unwrap();
        let mut envs: Vec<String> = response.container_responses[0]
            .envs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        envs.sort();
        assert_eq!(envs, expected);
    }
}

#[tokio::test]
async fn device_specs_mode_adds_the_env_to_every_container() {
    let mut h = Harness::new(Shape::P4d);
    let dir = spec_dir(&h).display().to_string();
    h.spawn_plugin(&[
        "--cdi-spec-dir",
        &dir,
        "--allocate-env",
        "FI_PROVIDER=efa",
        "--allocate-env",
        "NCCL_SOCKET_IFNAME=^lo,docker",
        "--allocate-env",
        "FI_EFA_USE_DEVICE_RDMA=1",
    ]);
    h.registered().await;
    let response = h
        .allocate(&[&["rdmap16s27"], &["rdmap32s27"]])
        .await
        .unwrap();
    for container in &response.container_responses {
        let mut envs: Vec<(&str, &str)> = container
            .envs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        envs.sort();
        assert_eq!(
            envs,
            [
                ("FI_EFA_USE_DEVICE_RDMA", "1"),
                ("FI_PROVIDER", "efa"),
                ("NCCL_SOCKET_IFNAME", "^lo,docker"),
            ]
        );
        assert_eq!(container.devices.len(), 1);
        assert!(container.cdi_devices.is_empty());
    }
    assert!(!spec_dir(&h).exists(), "device-specs mode writes no spec");
}

#[tokio::test]
async fn shared_efas_have_one_cdi_device_per_replica() {
    let h = cdi_plugin(Shape::P4d, &["--sharing-replicas", "2"]).await;
    let spec = read_spec(&h).expect("spec written");
    let names = spec_names(&spec);
    assert_eq!(names.len(), 8);
    assert_eq!(&names[..2], ["rdmap144s27::0", "rdmap144s27::1"]);
    let response = h
        .allocate(&[&["rdmap32s27::1", "rdmap32s27::0"]])
        .await
        .unwrap();
    let container = &response.container_responses[0];
    // One EFA, one node, whichever of its replicas the kubelet handed over.
    assert_eq!(
        container
            .cdi_devices
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>(),
        ["vpc.amazonaws.com/efa=rdmap32s27::1"]
    );
}

#[tokio::test]
async fn spec_follows_the_devices_and_outlives_a_plugin_that_cannot_tell_who_needs_it() {
    let mut h = cdi_plugin(Shape::P4d, &[]).await;
    let initial = spec_names(&read_spec(&h).unwrap());
    assert_eq!(initial.len(), 4);
    // A device past the 32nd: its node has a dynamic major.
    let late = simulate::devices(Shape::Dense256).remove(32);
    h.node.add(&late).unwrap();
    h.wait("the new device", |v| v.devices.len() == 5).await;
    eventually("the rewritten spec", || {
        read_spec(&h).is_some_and(|spec| spec_names(&spec).contains(&late.ibdev))
    })
    .await;
    let spec = read_spec(&h).unwrap();
    let added = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == late.ibdev.as_str())
        .unwrap();
    assert_eq!(added["containerEdits"]["deviceNodes"][0]["major"], 511);
    let leftovers: Vec<_> = std::fs::read_dir(spec_dir(&h)).unwrap().flatten().collect();
    assert_eq!(leftovers.len(), 1, "only the spec, no temporary file");

    // No PodResources socket in this harness: whether a container still needs the spec cannot
    // be known, so it stays.
    let (status, _) = h.terminate_plugin();
    assert!(status.success());
    assert!(spec_dir(&h).join(SPEC_FILE).exists(), "kept on SIGTERM");
    assert!(h.plugin_log().contains("keeping the CDI spec"));
}

/// Starts a cdi-mode plugin with PCI IDs on a node whose kubelet says a pod holds
/// `rdmap16s27` (an ibdev name: the AWS plugin's, or this one's other ID strategy's), and waits
/// until the spec names it; the kubelet's PodResources stand-in and the plugin's flags.
async fn pci_ids_while_a_pod_holds_rdmap16s27(h: &mut Harness) -> (PodResourcesStub, Vec<String>) {
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let holder = pod("ml", "trainer-0", "main", RESOURCE, &["rdmap16s27"]);
    let kubelet = PodResourcesStub::start(&socket, vec![holder]).unwrap();
    let dir = spec_dir(h).display().to_string();
    let args: Vec<String> = [
        "--device-list-strategy",
        "cdi",
        "--cdi-spec-dir",
        &dir,
        "--device-id-strategy",
        "pci",
    ]
    .map(str::to_owned)
    .into();
    h.spawn_plugin(&args.iter().map(String::as_str).collect::<Vec<_>>());
    h.registered().await;
    eventually("the held name in the spec", || {
        read_spec(h).is_some_and(|spec| spec_names(&spec).contains(&"rdmap16s27".to_owned()))
    })
    .await;
    (kubelet, args)
}

/// Stops the plugin with SIGTERM, waited for off the runtime thread: the PodResources
/// stand-in on it must answer the plugin's last question.
async fn terminate(mut h: Harness) -> (Harness, std::process::ExitStatus) {
    tokio::task::spawn_blocking(move || {
        let (status, _) = h.terminate_plugin();
        (h, status)
    })
    .await
    .unwrap()
}

/// A node switched from ibdev to PCI IDs while a pod held `rdmap16s27`: the restarted plugin's
/// spec still resolves that name, to the same node, so the pod's container can restart; once
/// the pod is gone, the name goes too.
#[tokio::test]
async fn the_spec_keeps_the_names_pods_hold_across_an_id_strategy_switch() {
    let mut h = Harness::new(Shape::P4d);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let (kubelet, _) = pci_ids_while_a_pod_holds_rdmap16s27(&mut h).await;
    let spec = read_spec(&h).unwrap();
    let nodes = |name: &str| {
        spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .map(|d| d["containerEdits"]["deviceNodes"].clone())
    };
    assert_eq!(spec_names(&spec).len(), 5, "{:?}", spec_names(&spec));
    assert_eq!(nodes("rdmap16s27"), nodes("0000:10:1b.0"));
    assert!(nodes("rdmap16s27").is_some());

    // The pod ends: the kubelet lists no holder.
    drop(kubelet);
    let _kubelet = PodResourcesStub::start(&socket, Vec::new()).unwrap();
    eventually("the released name gone", || {
        read_spec(&h).is_some_and(|spec| spec_names(&spec).len() == 4)
    })
    .await;
}

/// A plugin restarted while the kubelet's PodResources does not answer yet keeps the held
/// foreign names of the spec the earlier run kept: a container restarted in that window must
/// still resolve its CDI name.
#[tokio::test]
async fn a_restarted_plugin_keeps_the_kept_specs_held_names_until_the_kubelet_answers() {
    let mut h = Harness::new(Shape::P4d);
    let (kubelet, args) = pci_ids_while_a_pod_holds_rdmap16s27(&mut h).await;
    let held = "rdmap16s27".to_owned();
    let (mut h, status) = terminate(h).await;
    assert!(status.success());

    kubelet.stall();
    h.spawn_plugin(&args.iter().map(String::as_str).collect::<Vec<_>>());
    h.registered().await;
    // The first write happens before registration; several polls go unanswered since.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let names = spec_names(&read_spec(&h).unwrap());
    assert!(names.contains(&held), "{names:?}");
    assert_eq!(names.len(), 5, "{names:?}");
    kubelet.recover();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(spec_names(&read_spec(&h).unwrap()).contains(&held));
}

/// Stops a cdi-mode plugin whose kubelet says `holders` hold EFAs, and tells whether the spec
/// is left behind.
async fn spec_left_after_sigterm(holders: Vec<PodResources>) -> bool {
    let mut h = Harness::new(Shape::P4d);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _kubelet = PodResourcesStub::start(&socket, holders).unwrap();
    let dir = spec_dir(&h).display().to_string();
    h.spawn_plugin(&["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir]);
    h.registered().await;
    eventually("the spec", || read_spec(&h).is_some()).await;
    let (h, status) = terminate(h).await;
    assert!(status.success());
    spec_dir(&h).join(SPEC_FILE).exists()
}

#[tokio::test]
async fn the_spec_stays_while_a_container_holds_an_efa_and_goes_when_none_does() {
    let holder = pod("ml", "trainer-0", "main", RESOURCE, &["rdmap16s27"]);
    assert!(
        spec_left_after_sigterm(vec![holder]).await,
        "a holder may restart"
    );
    let other = pod("ml", "gpu-only", "main", "nvidia.com/gpu", &["GPU-0"]);
    assert!(
        !spec_left_after_sigterm(vec![other]).await,
        "nobody needs it"
    );
}

#[tokio::test]
async fn no_spec_until_there_is_a_device() {
    let mut h = Harness::new(Shape::NoEfa);
    let dir = spec_dir(&h).display().to_string();
    h.spawn_plugin(&["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir]);
    h.wait("an empty registration", |v| {
        v.stream_open && v.snapshots > 0
    })
    .await;
    // CDI counts a spec without devices as an error, so there is none.
    assert!(read_spec(&h).is_none());
    let late = simulate::devices(Shape::P4d).remove(0);
    h.node.add(&late).unwrap();
    eventually("the first spec", || {
        read_spec(&h).is_some_and(|spec| spec_names(&spec) == [late.ibdev.clone()])
    })
    .await;
}

#[tokio::test]
async fn a_failed_spec_write_is_retried_logged_and_counted() {
    let mut h = Harness::new(Shape::P4d);
    // A regular file where the spec dir should be: every write fails until it is replaced.
    let dir = spec_dir(&h);
    std::fs::write(&dir, "").unwrap();
    let dir_arg = dir.display().to_string();
    h.spawn_plugin(&["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir_arg]);
    h.registered().await;
    h.scrape_until("failed writes", |text| {
        sample(text, FAILURES).is_some_and(|n| n >= 2.0)
    })
    .await;
    let log = h.plugin_log();
    assert_eq!(
        log.matches("cannot write the CDI spec").count(),
        1,
        "one line for the streak\n{log}"
    );
    std::fs::remove_file(&dir).unwrap();
    eventually("the retried write", || read_spec(&h).is_some()).await;
    eventually("the recovery log line", || {
        h.plugin_log().contains("wrote the CDI spec after failures")
    })
    .await;
    assert!(read_spec(&h).is_some_and(|spec| spec_names(&spec).len() == 4));
}

#[test]
fn strategy_spec_dir_and_env_come_from_flags_env_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "device-list-strategy: cdi\ncdi-spec-dir: /etc/cdi\nallocate:\n  env:\n    FI_PROVIDER: efa\n    FI_EFA_USE_DEVICE_RDMA: 1\n",
    );
    let effective = |args: &[&str], env: &[(&str, &str)]| {
        let (code, stdout, stderr) = run_binary(args, env);
        assert_eq!(code, 0, "{stderr}");
        serde_yaml::from_str::<serde_yaml::Value>(&stdout).unwrap()
    };
    let defaults = effective(&["config"], &[]);
    assert_eq!(defaults["device-list-strategy"], "device-specs");
    assert_eq!(defaults["cdi-spec-dir"], "/var/run/cdi");
    assert_eq!(
        defaults["allocate"]["env"],
        serde_yaml::Value::Mapping(serde_yaml::Mapping::new())
    );

    let from_file = effective(&["--config", &config, "config"], &[]);
    assert_eq!(from_file["device-list-strategy"], "cdi");
    assert_eq!(from_file["cdi-spec-dir"], "/etc/cdi");
    assert_eq!(from_file["allocate"]["env"]["FI_EFA_USE_DEVICE_RDMA"], "1");
    assert_eq!(from_file["allocate"]["env"]["FI_PROVIDER"], "efa");

    let from_env = effective(
        &["--config", &config, "config"],
        &[
            ("EFA_DP_DEVICE_LIST_STRATEGY", "device-specs"),
            ("EFA_DP_ALLOCATE_ENV", "{A: 1, B: 2}"),
        ],
    );
    assert_eq!(from_env["device-list-strategy"], "device-specs");
    let env = from_env["allocate"]["env"].as_mapping().unwrap();
    assert_eq!(
        env.len(),
        2,
        "the variable replaces the file's map: {env:?}"
    );

    let from_flag = effective(
        &["--config", &config, "--allocate-env", "C=3", "config"],
        &[("EFA_DP_ALLOCATE_ENV", "{A: 1}")],
    );
    assert_eq!(
        from_flag["allocate"]["env"],
        serde_yaml::from_str::<serde_yaml::Value>("{C: '3'}").unwrap()
    );
}

#[test]
fn bad_strategy_and_env_are_refused_with_one_line() {
    assert_one_line_error(
        run_binary(&["--device-list-strategy", "oci"], &[]),
        &["--device-list-strategy", "oci"],
    );
    assert_one_line_error(
        run_binary(&["--allocate-env", "FI-PROVIDER=efa"], &[]),
        &["--allocate-env", "FI-PROVIDER"],
    );
    assert_one_line_error(
        run_binary(&[], &[("EFA_DP_ALLOCATE_ENV", "{A: 1, B-C: 2}")]),
        &["EFA_DP_ALLOCATE_ENV", "B-C"],
    );
    // The syntax of the flag is no map, and the variable's no pair list.
    assert_one_line_error(
        run_binary(&[], &[("EFA_DP_ALLOCATE_ENV", "A=1,B=2")]),
        &["EFA_DP_ALLOCATE_ENV", "map"],
    );
    assert_one_line_error(
        run_binary(&["--allocate-env", "FI_PROVIDER"], &[]),
        &["--allocate-env", "KEY=VALUE"],
    );
    assert_one_line_error(
        run_binary(&[], &[("EFA_DP_ALLOCATE_ENV", "{1X: y}")]),
        &["EFA_DP_ALLOCATE_ENV", "1X"],
    );
    assert_one_line_error(
        run_binary(
            &[
                "--device-list-strategy",
                "cdi",
                "--resource-name",
                "example.com/1efa",
            ],
            &[],
        ),
        &["--resource-name", "CDI"],
    );
    let dir = tempfile::tempdir().unwrap();
    for (yaml, names) in [
        (
            "allocate:\n  env:\n    \"FI PROVIDER\": efa\n",
            &["allocate.env.FI PROVIDER", "name"][..],
        ),
        (
            "allocate:\n  env:\n    A: \"x\\0y\"\n",
            &["allocate.env.A", "NUL"],
        ),
        ("allocate:\n  env:\n    A: [1]\n", &["allocate.env.A"]),
        ("allocate:\n  environment: {}\n", &["environment"]),
        (
            "device-list-strategy: oci\n",
            &["device-list-strategy", "oci"],
        ),
    ] {
        let config = write_config(dir.path(), yaml);
        let mut names = names.to_vec();
        names.push(&config);
        assert_one_line_error(run_binary(&["--config", &config], &[]), &names);
    }
}

/// Writes each fixture's spec, as the plugin wrote it, with the names Allocate answered for
/// every advertised ID, into `$EFA_DP_CDI_SPEC_OUT/<fixture>/`, for tests/cdi/validate.sh to
/// check against the upstream schema and library.
#[tokio::test]
#[ignore = "run by tests/cdi/validate.sh, which validates what it writes"]
async fn write_specs_for_validation() {
    let out = PathBuf::from(std::env::var_os("EFA_DP_CDI_SPEC_OUT").expect("EFA_DP_CDI_SPEC_OUT"));
    let env = [
        "--allocate-env",
        "FI_PROVIDER=efa",
        "--allocate-env",
        "FI_EFA_USE_DEVICE_RDMA=1",
    ];
    let fixtures: [(&str, Shape, usize, &[&str]); 5] = [
        ("p4d", Shape::P4d, 1, &env),
        ("p5", Shape::P5, 1, &[]),
        ("dense256", Shape::Dense256, 1, &env),
        ("p4d-shared", Shape::P4d, 4, &env),
        ("dense256-shared", Shape::Dense256, 8, &[]),
    ];
    for (fixture, shape, replicas, extra) in fixtures {
        let replicas_arg = replicas.to_string();
        let mut args = vec!["--sharing-replicas", &replicas_arg];
        args.extend_from_slice(extra);
        let mut h = cdi_plugin(shape, &args).await;
        let expected = h.efas().len() * replicas;
        let view = h.wait("every ID", |v| v.devices.len() == expected).await;
        let ids: Vec<&str> = view.devices.iter().map(|d| d.id.as_str()).collect();
        let containers: Vec<&[&str]> = ids.chunks(1).collect();
        let names: Vec<String> = h
            .allocate(&containers)
            .await
            .unwrap()
            .container_responses
            .into_iter()
            .flat_map(|c| c.cdi_devices.into_iter().map(|d| d.name))
            .collect();
        assert_eq!(names.len(), expected, "{fixture}: one name per ID");
        eventually("the spec with every ID", || {
            read_spec(&h).is_some_and(|spec| spec_names(&spec).len() == expected)
        })
        .await;
        let dir = out.join(fixture);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(spec_dir(&h).join(SPEC_FILE), dir.join(SPEC_FILE)).unwrap();
        std::fs::write(dir.join("expected-devices.txt"), names.join("\n") + "\n").unwrap();
        let (status, _) = h.terminate_plugin();
        assert!(status.success(), "{fixture}");
        // No PodResources here to say that no container needs it.
        assert!(
            spec_dir(&h).join(SPEC_FILE).exists(),
            "{fixture}: kept on exit"
        );
    }
}
