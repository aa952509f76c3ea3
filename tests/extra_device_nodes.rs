//! `--extra-device-nodes` on the real binary: a fake `/dev/gdrdrv` in the simulated node's dev
//! root reaches every container with EFAs, once, next to its uverbs nodes; a missing one is left
//! out and logged, and the plugin serves its EFAs all the same.

mod support;

use efa_device_plugin::discovery::DevNum;
use efa_device_plugin::testkit::simulate::{Shape, make_char_device};
use support::Harness;

/// The simulated node's `/dev/gdrdrv`: a real character device when the test may create one,
/// else a link to the host's `/dev/null`, which the plugin's look-up follows.
fn fake_gdrdrv(h: &Harness) {
    let path = h.node.dev.join("gdrdrv");
    let number = DevNum {
        major: 235,
        minor: 0,
    };
    if make_char_device(&path, number).is_err() {
        std::os::unix::fs::symlink("/dev/null", &path).unwrap();
    }
}

#[tokio::test]
async fn every_container_with_efas_gets_the_extra_node_once_and_a_missing_one_is_skipped() {
    let mut h = Harness::new(Shape::P5en);
    fake_gdrdrv(&h);
    h.spawn_plugin(&[
        "--extra-device-nodes",
        "/dev/gdrdrv,/dev/nvidia-absent",
        "--log-format",
        "json",
    ]);
    h.registered().await;
    let ids: Vec<String> = h.efas().iter().take(2).map(|d| d.ibdev.clone()).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let other = h.efas()[2].ibdev.clone();
    let response = h.allocate(&[&ids, &[&other]]).await.unwrap();
    let gdrdrv = h.node.dev.join("gdrdrv").display().to_string();
    for (container, efas) in response.container_responses.iter().zip([2, 1]) {
        let paths: Vec<(&str, &str)> = container
            .devices
            .iter()
            .map(|d| (d.container_path.as_str(), d.host_path.as_str()))
            .collect();
        assert_eq!(
            paths
                .iter()
                .filter(|(c, _)| c.starts_with("/dev/infiniband/uverbs"))
                .count(),
            efas,
            "{paths:?}"
        );
        assert_eq!(
            paths
                .iter()
                .filter(|p| **p == ("/dev/gdrdrv", gdrdrv.as_str()))
                .count(),
            1,
            "once per container, whatever its EFAs: {paths:?}"
        );
        assert_eq!(
            paths.len(),
            efas + 1,
            "the absent node is left out: {paths:?}"
        );
    }
    let log = h.plugin_log();
    assert!(
        log.contains("extra device node left out of containers until it appears")
            && log.contains("nvidia-absent is missing"),
        "{log}"
    );
}

#[test]
fn a_node_outside_dev_or_inside_dev_infiniband_exits_2_naming_the_flag() {
    for bad in [
        "gdrdrv",
        "/dev/../etc/shadow",
        "/dev/infiniband/uverbs9",
        "/dev/",
    ] {
        let (code, _, stderr) = support::run_binary(&["--extra-device-nodes", bad], &[]);
        assert_eq!(code, 2, "{bad}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("--extra-device-nodes"), "{stderr}");
    }
    let (code, _, stderr) =
        support::run_binary(&[], &[("EFA_DP_EXTRA_DEVICE_NODES", "/dev/infiniband")]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("EFA_DP_EXTRA_DEVICE_NODES"), "{stderr}");
}
