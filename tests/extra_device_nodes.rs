//! `--extra-device-nodes` on the real binary: a fake `/dev/gdrdrv` in the simulated node's dev
//! root reaches every container with EFAs, once, next to its uverbs nodes; a missing one is left
//! out and logged, and the plugin serves its EFAs all the same. A node that is, or leads to, an
//! EFA's uverbs node or a node outside the dev root never reaches a container: at start the
//! plugin exits 2 naming the flag, later the node is withheld and logged once.

mod support;

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use efa_device_plugin::discovery::DevNum;
use efa_device_plugin::testkit::simulate::{Shape, make_char_device};
use support::{Harness, TIMEOUT};

/// The simulated node's `/dev/gdrdrv`, a character device, where the test may create one; a
/// link to the host's `/dev/null` would leave the dev root, which the plugin refuses.
fn fake_gdrdrv(h: &Harness) -> bool {
    let number = DevNum {
        major: 235,
        minor: 0,
    };
    match make_char_device(&h.node.dev.join("gdrdrv"), number) {
        Ok(()) => true,
        Err(err) => {
            eprintln!("skipped: creating a character device needs CAP_MKNOD: {err}");
            false
        }
    }
}

#[tokio::test]
async fn every_container_with_efas_gets_the_extra_node_once_and_a_missing_one_is_skipped() {
    let mut h = Harness::new(Shape::P5en);
    if !fake_gdrdrv(&h) {
        return;
    }
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

/// The two ways a node led to what the plugin must not hand every container: udev's link to
/// the first EFA's uverbs node, `/dev/char/231:192`, on every host, and a link out of the dev
/// root. Each as containers name it, with the path it resolves to.
fn bad_links(h: &Harness) -> [(String, PathBuf); 2] {
    let efa = h.efas()[0];
    let uverbs = Path::new("infiniband").join(efa.uverbs_name());
    let dev = &h.node.dev;
    [
        (format!("/dev/char/{}", efa.dev), dev.join(&uverbs)),
        ("/dev/gdrcopy".to_owned(), PathBuf::from("/dev/null")),
    ]
}

fn make_links(h: &Harness) {
    let dev = &h.node.dev;
    std::fs::create_dir_all(dev.join("char")).unwrap();
    for (node, target) in bad_links(h) {
        let at = dev.join(node.strip_prefix("/dev/").unwrap());
        std::os::unix::fs::symlink(target, at).unwrap();
    }
}

/// The flags of each strategy, with the spec dir in the harness for cdi.
fn strategies(h: &Harness) -> [Vec<String>; 2] {
    let spec_dir = h.root.path().join("cdi").display().to_string();
    [
        vec![],
        ["--device-list-strategy", "cdi", "--cdi-spec-dir", &spec_dir]
            .map(str::to_owned)
            .to_vec(),
    ]
}

/// The CDI spec's text, if the plugin wrote one.
fn spec_text(h: &Harness) -> Option<String> {
    std::fs::read_to_string(h.root.path().join("cdi/vpc.amazonaws.com-efa.json")).ok()
}

/// Waits for the plugin to exit by itself.
async fn exit_status(h: &mut Harness) -> ExitStatus {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = h.plugin_exited() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the plugin kept running:\n{}",
            h.plugin_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_node_that_is_an_efas_or_leaves_the_dev_root_at_start_exits_2_naming_the_flag() {
    let mut h = Harness::new(Shape::P4d);
    make_links(&h);
    let real_dev = std::fs::canonicalize(&h.node.dev).unwrap();
    for strategy in strategies(&h) {
        for (node, leads_to) in bad_links(&h) {
            let log_before = h.plugin_log().len();
            let mut args: Vec<&str> = strategy.iter().map(String::as_str).collect();
            args.extend(["--extra-device-nodes", &node]);
            h.spawn_plugin(&args);
            let status = exit_status(&mut h).await;
            let log = h.plugin_log()[log_before..].to_owned();
            assert_eq!(status.code(), Some(2), "{args:?}: {log}");
            let why = if leads_to.starts_with(&real_dev) {
                format!("in {}", real_dev.join("infiniband").display())
            } else {
                format!("outside the dev root {}", real_dev.display())
            };
            let last = log.trim().lines().last().unwrap_or_default();
            let host_path = h.node.dev.join(node.strip_prefix("/dev/").unwrap());
            assert!(
                last.starts_with(&format!(
                    "--extra-device-nodes {node}: {} resolves to {}, {why}",
                    host_path.display(),
                    leads_to.display()
                )),
                "{args:?}: {last}"
            );
            assert!(
                !spec_text(&h).is_some_and(|spec| spec.contains(&node)),
                "{args:?}: {:?}",
                spec_text(&h)
            );
        }
    }
    // The variable that gave the node is named as the flag would be.
    let node = &bad_links(&h)[0].0;
    h.spawn_plugin_with(&[], |command| {
        command.env("EFA_DP_EXTRA_DEVICE_NODES", node);
    });
    assert_eq!(exit_status(&mut h).await.code(), Some(2));
    let log = h.plugin_log();
    let last = log.trim().lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("EFA_DP_EXTRA_DEVICE_NODES {node}: ")),
        "{last}"
    );
}

/// Missing at the start, the two links appear once the plugin serves, as udev's does when the
/// EFA driver loads after it: neither reaches a container, in either strategy, and each is
/// logged once while it lasts. A real gdrdrv appearing with them, where the test may create
/// one, shows the look-up has run.
#[tokio::test]
async fn a_node_that_leads_to_an_efa_or_out_of_the_dev_root_later_is_withheld_and_logged_once() {
    for strategy in 0..2 {
        let mut h = Harness::new(Shape::P4d);
        let bad: Vec<String> = bad_links(&h).into_iter().map(|(node, _)| node).collect();
        let nodes = format!("{},/dev/gdrdrv", bad.join(","));
        let mut args: Vec<String> = strategies(&h)[strategy].clone();
        args.extend(["--extra-device-nodes", &nodes, "--log-format", "json"].map(str::to_owned));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        h.spawn_plugin(&args);
        h.registered().await;
        make_links(&h);
        let gdrdrv = fake_gdrdrv(&h);
        let withheld = |log: &str, node: &str| {
            log.lines()
                .filter(|line| line.contains("extra device node withheld from containers"))
                .filter(|line| line.contains(&format!("\"node\":\"{node}\"")))
                .count()
        };
        support::eventually("both links withheld", || {
            let log = h.plugin_log();
            bad.iter().all(|node| withheld(&log, node) == 1)
        })
        .await;
        if gdrdrv {
            support::eventually("gdrdrv handed out", || {
                h.plugin_log()
                    .contains("every container with EFAs gets this extra device node")
                    && (strategy == 0
                        || spec_text(&h).is_some_and(|spec| spec.contains("\"/dev/gdrdrv\"")))
            })
            .await;
        }
        let efa = h.efas()[1].ibdev.clone();
        let response = h.allocate(&[&[&efa]]).await.unwrap();
        let handed: Vec<&str> = response.container_responses[0]
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        let spec = spec_text(&h).unwrap_or_default();
        for node in &bad {
            assert!(!handed.contains(&node.as_str()), "{node}: {handed:?}");
            assert!(!spec.contains(node.as_str()), "{node}: {spec}");
        }
        if strategy == 0 {
            assert_eq!(handed.len(), 1 + usize::from(gdrdrv), "{handed:?}");
        } else {
            assert!(handed.is_empty(), "cdi names only: {handed:?}");
        }
        // Five more rescans of 200 ms: the refusal is not logged again while it lasts.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let log = h.plugin_log();
        for node in &bad {
            assert_eq!(withheld(&log, node), 1, "{log}");
        }
    }
}
