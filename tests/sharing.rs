//! Opt-in sharing against the real binary: replica IDs in the device list, Allocate mapping
//! replicas to their EFA's node, health and GPA applying to replicas, and the setting's sources.

mod support;

use efa_device_plugin::proto::deviceplugin::{HEALTHY, UNHEALTHY};
use efa_device_plugin::testkit::kubelet_stub::KubeletView;
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, run_binary};
use tonic::Code;

async fn shared_p4d(replicas: u32) -> (Harness, KubeletView) {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&["--sharing-replicas", &replicas.to_string()]);
    let expected = h.efas().len() * replicas as usize;
    let view = h
        .wait("registration with replicas", |v| {
            v.stream_open && v.devices.len() == expected
        })
        .await;
    (h, view)
}

#[tokio::test]
async fn each_efa_is_listed_once_per_replica_with_its_numa_node() {
    let (h, view) = shared_p4d(2).await;
    let ids: Vec<&str> = view.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "rdmap144s27::0",
            "rdmap144s27::1",
            "rdmap160s27::0",
            "rdmap160s27::1",
            "rdmap16s27::0",
            "rdmap16s27::1",
            "rdmap32s27::0",
            "rdmap32s27::1",
        ]
    );
    for device in &view.devices {
        let efa = h
            .efas()
            .into_iter()
            .find(|e| device.id.starts_with(&e.ibdev))
            .unwrap();
        let numa = device.topology.as_ref().unwrap().nodes[0].id;
        assert_eq!(numa, i64::from(efa.numa), "{}", device.id);
        assert_eq!(device.health, HEALTHY);
    }
}

#[tokio::test]
async fn replicas_of_one_efa_open_its_node_once() {
    let (h, _) = shared_p4d(3).await;
    let response = h
        .allocate(&[&["rdmap16s27::0", "rdmap16s27::2", "rdmap144s27::1"]])
        .await
        .unwrap();
    let nodes: Vec<&str> = response.container_responses[0]
        .devices
        .iter()
        .map(|s| s.container_path.as_str())
        .collect();
    let efas = h.efas();
    let node_of = |ibdev: &str| {
        let efa = efas.iter().find(|e| e.ibdev == ibdev).unwrap();
        format!("/dev/infiniband/{}", efa.uverbs_name())
    };
    let mut want = vec![node_of("rdmap16s27"), node_of("rdmap144s27")];
    want.sort();
    let mut got: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
    got.sort();
    assert_eq!(got, want);

    // Only advertised IDs are served: no replica past N, no bare address.
    for id in ["rdmap16s27::3", "rdmap16s27"] {
        let err = h.allocate(&[&[id]]).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{id}");
        assert!(err.message().contains(id), "{}", err.message());
    }
}

#[tokio::test]
async fn health_applies_to_every_replica() {
    let (h, _) = shared_p4d(2).await;
    let victim = h.efas()[1].clone();
    h.node.remove_node(&victim).unwrap();
    let view = h
        .wait("both replicas unhealthy", |v| v.healthy() == 6)
        .await;
    for device in &view.devices {
        let expected = if device.id.starts_with(&victim.ibdev) {
            UNHEALTHY
        } else {
            HEALTHY
        };
        assert_eq!(device.health, expected, "{}", device.id);
    }
    let err = h
        .allocate(&[&[&format!("{}::1", victim.ibdev)]])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn preferred_replicas_spread_over_distinct_efas() {
    let (h, view) = shared_p4d(4).await;
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(h.prefer(all, 2).await, ["rdmap16s27::0", "rdmap32s27::0"]);
}

#[test]
fn replicas_come_from_flag_env_file_or_default() {
    let replicas = |stdout: &str| {
        let effective: serde_yaml::Value = serde_yaml::from_str(stdout).unwrap();
        effective["sharing"]["replicas"].as_u64().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "sharing:\n  replicas: 4\n").unwrap();
    let config = config.display().to_string();
    let env = [("EFA_DP_SHARING_REPLICAS", "3")];

    let (_, stdout, _) = run_binary(&["config"], &[]);
    assert_eq!(replicas(&stdout), 1);
    let (_, stdout, _) = run_binary(&["--config", &config, "config"], &[]);
    assert_eq!(replicas(&stdout), 4);
    let (_, stdout, _) = run_binary(&["--config", &config, "config"], &env);
    assert_eq!(replicas(&stdout), 3);
    let (code, stdout, stderr) = run_binary(
        &["--config", &config, "--sharing-replicas", "2", "config"],
        &env,
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(replicas(&stdout), 2);
}

#[test]
fn bad_replica_counts_are_one_line_naming_their_source() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "sharing:\n  replicas: 0\n").unwrap();
    let config = config.display().to_string();
    let env = |value| vec![("EFA_DP_SHARING_REPLICAS", value)];
    let cases = [
        (
            vec!["--sharing-replicas", "0"],
            vec![],
            "--sharing-replicas",
        ),
        (vec![], env("many"), "EFA_DP_SHARING_REPLICAS"),
        (vec!["--sharing-replicas", "65"], vec![], "at most 64"),
        (
            vec!["--config", config.as_str()],
            vec![],
            "sharing.replicas",
        ),
    ];
    for (args, env, names) in cases {
        let (code, _, stderr) = run_binary(&[args.as_slice(), &["config"]].concat(), &env);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr:?}");
        assert!(stderr.contains(names), "{stderr:?} does not name {names:?}");
    }
}
