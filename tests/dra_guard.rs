//! The DRA-conflict guard of the real binary: a DRA driver's registration socket withholds every
//! EFA, its removal gives them back, and `--allow-dra-coexistence` turns the guard off.

mod support;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use efa_device_plugin::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use efa_device_plugin::simulate::Shape;
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

fn conflict(text: &str) -> Option<f64> {
    sample(text, "efa_device_plugin_dra_conflict")
}

#[tokio::test]
async fn a_registered_dra_driver_withholds_every_device_until_it_goes() {
    let mut h = Harness::new(Shape::P4d);
    // Another driver's registration is no conflict.
    let _gpu = UnixListener::bind(registry(&h).join("gpu.nvidia.com-reg.sock")).unwrap();
    h.spawn_plugin(&["--log-format", "json"]);
    h.registered().await;
    let id = h.efas()[0].bdf.clone();

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
    let refused = h
        .kubelet
        .plugin()
        .unwrap()
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![id.clone()],
            }],
        })
        .await
        .unwrap_err();
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
