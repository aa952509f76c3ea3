//! Replacing another plugin for the same resource: a competitor's socket is reported, not
//! fought over, and EFAs that pods hold under foreign IDs are seen and steered around.

mod support;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, sample};

const AWS_SOCKET: &str = "aws-efa-device-plugin.sock";

#[tokio::test]
async fn a_live_competitor_is_reported_and_not_fought_until_it_goes() {
    let mut h = Harness::new(Shape::P4d);
    // The other plugin serves its socket before this one starts.
    let competitor = UnixListener::bind(h.plugin_dir.join(AWS_SOCKET)).unwrap();
    h.spawn_plugin(&[]);
    // Installed on purpose: it registers once all the same.
    let view = h.registered().await;
    assert_eq!(view.register_calls, 1);
    let text = h
        .scrape_until("the competitor gauge", |t| {
            sample(t, "efa_device_plugin_competing_plugin") == Some(1.0)
        })
        .await;
    assert_eq!(
        sample(&text, "efa_device_plugin_registrations_total"),
        Some(1.0)
    );
    let log = h.plugin_log();
    assert_eq!(
        log.matches("another device plugin serves this resource")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains(AWS_SOCKET), "{log}");

    // The kubelet hands the resource to the other plugin: this one stays away.
    h.kubelet.end_stream();
    h.wait("the ended stream", |v| !v.stream_open).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(h.kubelet.view().borrow().register_calls, 1);
    let (code, body) = h.get("/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains(AWS_SOCKET), "{body}");

    // It goes: registered again within a second.
    drop(competitor);
    std::fs::remove_file(h.plugin_dir.join(AWS_SOCKET)).unwrap();
    let gone = Instant::now();
    h.wait("registration after the competitor left", |v| {
        v.register_calls == 2 && v.stream_open
    })
    .await;
    assert!(
        gone.elapsed() < Duration::from_secs(1),
        "{:?}",
        gone.elapsed()
    );
    h.scrape_until("the competitor gauge back at 0", |t| {
        sample(t, "efa_device_plugin_competing_plugin") == Some(0.0)
    })
    .await;
    assert_eq!(h.get("/readyz").await.0, 200);
}

#[tokio::test]
async fn a_stale_socket_file_is_no_competitor() {
    let mut h = Harness::new(Shape::P4d);
    // Bound and closed: the file stays, connections are refused.
    drop(UnixListener::bind(h.plugin_dir.join(AWS_SOCKET)).unwrap());
    h.spawn_plugin(&[]);
    h.registered().await;
    let text = h.scrape_until("metrics", |t| t.contains("competing")).await;
    assert_eq!(
        sample(&text, "efa_device_plugin_competing_plugin"),
        Some(0.0)
    );
    h.kubelet.end_stream();
    h.wait("registration after the ended stream", |v| {
        v.register_calls == 2 && v.stream_open
    })
    .await;
}

#[tokio::test]
async fn foreign_ids_are_counted_named_and_steered_around() {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    let socket: PathBuf = h.root.path().join("pod-resources/kubelet.sock");
    // A pod started under the AWS plugin holds the two NUMA-0 EFAs by their ibdev names.
    let _kubelet = PodResourcesStub::start(
        &socket,
        vec![pod(
            "ml",
            "holder",
            "main",
            "vpc.amazonaws.com/efa",
            &[&efas[0].ibdev, &efas[1].ibdev],
        )],
    )
    .unwrap();
    h.spawn_plugin(&["--device-id-strategy", "pci"]);
    let view = h.registered().await;
    let text = h
        .scrape_until("the foreign-ID gauge", |t| {
            sample(t, "efa_device_plugin_foreign_allocations") == Some(2.0)
        })
        .await;
    // Their traffic is still the holder's.
    let held = format!(
        "efa_device_allocation{{device=\"{}\",namespace=\"ml\",pod=\"holder\",container=\"main\"}}",
        efas[0].bdf
    );
    assert!(sample(&text, &held).is_some(), "{text}");
    let log = h.plugin_log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("IDs this plugin does not advertise"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(
        warnings[0].contains("pod=holder") && warnings[0].contains(&efas[0].ibdev),
        "{}",
        warnings[0]
    );

    // The kubelet counts those two as free and offers all four: the free pair is preferred.
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(
        h.prefer(all, 2).await,
        [efas[2].bdf.clone(), efas[3].bdf.clone()]
    );
}
