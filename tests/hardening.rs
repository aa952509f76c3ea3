//! The real binary against what an outsider, a slow file or a faulty kernel can do: a flood of
//! connections, files that block or lie, a sysfs that cannot be listed.

mod support;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use efa_device_plugin::proto::deviceplugin::{HEALTHY, UNHEALTHY};
use efa_device_plugin::testkit::frozen::FrozenSocket;
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape};
use support::{Harness, eventually, fds_and_tasks, sample};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The endpoint's connection cap (`telemetry::fds::MAX_CONNECTIONS`).
const CAP: usize = efa_device_plugin::telemetry::fds::MAX_CONNECTIONS;

/// Whether the server closed `stream` within `wait`.
async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(wait, stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

async fn connect_many(address: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut streams = Vec::with_capacity(count);
    for _ in 0..count {
        streams.push(TcpStream::connect(address).await.expect("connect"));
    }
    streams
}

#[tokio::test]
async fn a_flood_of_idle_connections_is_capped_and_the_devices_never_notice() {
    let mut h = Harness::new(Shape::P4d);
    let pid = h.spawn_plugin(&[]);
    h.registered().await;
    let address = h.metrics_address().await;
    let (fds_before, _) = fds_and_tasks(pid);
    let snapshots = h.kubelet.view().borrow().snapshots;

    let flood = connect_many(address, 10 * CAP).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (fds_during, _) = fds_and_tasks(pid);
    // Past the cap, each connection is closed as soon as it is accepted.
    let mut open = Vec::new();
    for mut stream in flood {
        if !closed_within(&mut stream, Duration::from_millis(10)).await {
            open.push(stream);
        }
    }
    assert!(open.len() <= CAP, "{} connections held open", open.len());
    assert!(
        fds_during <= fds_before + CAP + 4,
        "{fds_during} fds with the flood, {fds_before} before"
    );
    let efa = h.efas()[0].ibdev.clone();
    h.allocate(&[&[&efa]])
        .await
        .expect("Allocate during the flood");
    let view = h.kubelet.view().borrow().clone();
    assert_eq!(view.snapshots, snapshots, "the device state changed");
    assert_eq!(view.healthy(), 4);

    // The idle connections that got a slot lose it at the header timeout.
    for stream in &mut open {
        assert!(closed_within(stream, Duration::from_secs(5)).await);
    }
    assert_eq!(h.get("/healthz").await, (200, "ok\n".into()));
}

#[tokio::test]
async fn a_connection_that_never_finishes_its_request_is_dropped() {
    let mut h = Harness::new(Shape::G5);
    h.spawn_plugin(&[]);
    let address = h.metrics_address().await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\n")
        .await
        .unwrap();
    // The request head never ends: gone at the 2 s header timeout.
    assert!(closed_within(&mut stream, Duration::from_secs(4)).await);
}

#[tokio::test]
async fn a_busy_kept_alive_connection_ends_at_the_connection_deadline() {
    let mut h = Harness::new(Shape::G5);
    h.spawn_plugin(&[]);
    let address = h.metrics_address().await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    let opened = Instant::now();
    // A request a second never leaves the connection idle for the 2 s timeout, so only the
    // 10 s whole-connection deadline can end it.
    let mut answered = 0;
    let closed_after = loop {
        if opened.elapsed() > Duration::from_secs(15) {
            panic!("still open after 15 s and {answered} answers");
        }
        let written = stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: plugin\r\n\r\n")
            .await;
        let mut answer = [0u8; 512];
        match tokio::time::timeout(Duration::from_secs(3), stream.read(&mut answer)).await {
            Ok(Ok(n)) if n > 0 && written.is_ok() => {
                assert!(answer[..n].starts_with(b"HTTP/1.1 200"));
                answered += 1;
            }
            _ => break opened.elapsed(),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(
        closed_after >= Duration::from_secs(9) && answered >= 8,
        "closed after {closed_after:?} and {answered} answers"
    );
}

#[tokio::test]
async fn an_idle_kept_alive_connection_gives_its_slot_back() {
    let mut h = Harness::new(Shape::G5);
    h.spawn_plugin(&[]);
    let address = h.metrics_address().await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: plugin\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 512];
    let n = stream.read(&mut answer).await.unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"));
    // Answered and kept alive, the connection gives its slot back at the 2 s idle timeout.
    assert!(closed_within(&mut stream, Duration::from_secs(4)).await);
}

// pre_exec is the one way to give only the child a lower limit than this test process has.
#[allow(unsafe_code)]
#[tokio::test]
async fn the_soft_fd_limit_is_raised_to_the_hard_limit() {
    let mut h = Harness::new(Shape::G5);
    let pid = h.spawn_plugin_with(&[], |command| {
        // SAFETY: setrlimit is async-signal-safe and touches only the child.
        unsafe {
            command.pre_exec(|| {
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_NOFILE,
                    512,
                    4096,
                )
                .map_err(std::io::Error::from)
            });
        }
    });
    h.metrics_address().await;
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<&str> = open_files.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["4096", "4096"], "{open_files}");
}

#[tokio::test]
async fn a_sysfs_that_cannot_be_listed_keeps_the_devices_and_fails_healthz() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let class = h.node.sysfs.join("class/infiniband");
    let aside = h.node.sysfs.join("class/infiniband.aside");
    std::fs::rename(&class, &aside).unwrap();
    // Not a directory: ENOTDIR, an error that is not "absent".
    std::fs::write(&class, "").unwrap();

    let (status, body) = {
        let deadline = Instant::now() + support::TIMEOUT;
        loop {
            let answer = h.get("/healthz").await;
            if answer.0 != 200 || Instant::now() > deadline {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("sysfs scans failed") && body.contains("class/infiniband"),
        "{body}"
    );
    let view = h.kubelet.view().borrow().clone();
    assert_eq!(view.healthy(), 4, "a failed scan is not an empty node");
    let text = h.get("/metrics").await.1;
    let errors = sample(
        &text,
        "efa_device_plugin_scan_errors_total{reason=\"ENOTDIR\"}",
    );
    assert!(errors.is_some_and(|n| n >= 3.0), "{text}");
    let log = h.plugin_log();
    assert_eq!(
        log.matches("cannot list the RDMA devices").count(),
        1,
        "logged once while it lasts\n{log}"
    );

    std::fs::remove_file(&class).unwrap();
    std::fs::rename(&aside, &class).unwrap();
    let deadline = Instant::now() + support::TIMEOUT;
    while h.get("/healthz").await.0 != 200 {
        assert!(Instant::now() < deadline, "/healthz stayed failed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(h.plugin_log().contains("sysfs scans work again"));
}

/// Replaces `device`'s uverbs `dev` attribute with a FIFO, as a hung driver would leave a
/// read blocked.
fn fifo_at_dev(h: &Harness, device: &FakeDevice) {
    let dev = h
        .node
        .sysfs
        .join("class/infiniband")
        .join(&device.ibdev)
        .join("device/infiniband_verbs")
        .join(device.uverbs_name())
        .join("dev");
    std::fs::remove_file(&dev).unwrap();
    nix::unistd::mkfifo(&dev, nix::sys::stat::Mode::S_IRUSR).unwrap();
}

#[tokio::test]
async fn a_fifo_in_sysfs_marks_only_its_device_and_sigterm_still_ends_the_plugin() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    fifo_at_dev(&h, &efas[1]);
    let counters = h
        .node
        .sysfs
        .join("class/infiniband")
        .join(&efas[0].ibdev)
        .join("ports/1/hw_counters/stuck");
    nix::unistd::mkfifo(&counters, nix::sys::stat::Mode::S_IRUSR).unwrap();

    h.wait("the FIFO's device to turn Unhealthy", |v| {
        v.healthy() == 3
            && v.devices
                .iter()
                .any(|d| d.id == efas[1].ibdev && d.health == UNHEALTHY)
    })
    .await;
    assert_eq!(
        h.kubelet.view().borrow().health_of(&efas[0].ibdev),
        Some(HEALTHY)
    );
    assert!(h.plugin_log().contains("a FIFO"), "{}", h.plugin_log());
    // A FIFO among the counters costs that one counter, not the scrape.
    let (status, text) = h.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(!text.contains("efa_stuck_total"));

    let (status, took) = h.terminate_plugin();
    assert!(status.success(), "{}", h.plugin_log());
    assert!(took < Duration::from_secs(2), "{took:?}");
}

#[tokio::test]
async fn only_a_character_device_at_the_node_path_is_healthy() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let directory = h.node.node_path(&efas[0]);
    std::fs::remove_file(&directory).unwrap();
    std::fs::create_dir(&directory).unwrap();
    // A link to a node that is itself fine is still not the node.
    let link = h.node.node_path(&efas[1]);
    let target = h.root.path().join("elsewhere");
    std::fs::rename(&link, &target).unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();

    h.wait("both to turn Unhealthy", |v| v.healthy() == 2).await;
    assert_eq!(
        h.kubelet.view().borrow().health_of(&efas[0].ibdev),
        Some(UNHEALTHY)
    );
    assert_eq!(
        h.kubelet.view().borrow().health_of(&efas[1].ibdev),
        Some(UNHEALTHY)
    );
    let log = h.plugin_log();
    assert!(
        log.contains("is a directory, not a character device"),
        "{log}"
    );
    assert!(
        log.contains("is a symbolic link, not a character device"),
        "{log}"
    );
}

#[test]
fn a_regular_file_at_the_node_path_needs_the_test_only_switch() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = efa_device_plugin::testkit::simulate::FakeNode::build(
        dir.path(),
        Shape::G5,
        efa_device_plugin::testkit::simulate::Nodes::Files,
    )
    .unwrap();
    let (sysfs, dev) = (
        node.sysfs.display().to_string(),
        node.dev.display().to_string(),
    );
    let list = |extra: &[&str]| {
        let mut args = vec!["--sysfs-root", &sysfs, "--dev-root", &dev];
        args.extend_from_slice(extra);
        args.extend(["list", "--output", "json"]);
        let (code, stdout, stderr) = support::run_binary(&args, &[]);
        assert_eq!(code, 0, "{stderr}");
        let rows: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        rows[0]["health"].as_str().unwrap().to_owned()
    };
    assert_eq!(list(&[]), "Unhealthy");
    assert_eq!(list(&["--test-only-regular-file-nodes=true"]), "Healthy");
}

#[test]
fn list_does_not_hang_on_a_fifo_in_sysfs() {
    let dir = tempfile::tempdir().unwrap();
    let (node, devices) = efa_device_plugin::testkit::simulate::FakeNode::build(
        dir.path(),
        Shape::G5,
        support::node_kind(),
    )
    .unwrap();
    let numa = node
        .sysfs
        .join("class/infiniband")
        .join(&devices[0].ibdev)
        .join("device/numa_node");
    std::fs::remove_file(&numa).unwrap();
    nix::unistd::mkfifo(&numa, nix::sys::stat::Mode::S_IRUSR).unwrap();
    let mut child = std::process::Command::new(support::BINARY)
        .args(["--sysfs-root", &node.sysfs.display().to_string()])
        .args(["--dev-root", &node.dev.display().to_string()])
        .arg("--test-only-regular-file-nodes=true")
        .arg("list")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("list hangs on a FIFO in sysfs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no NUMA node for") && stderr.contains("a FIFO"),
        "{stderr}"
    );
}

#[tokio::test]
async fn an_unreadable_numa_node_is_logged_and_counted() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered().await;
    let efa = h.efas()[2].clone();
    let numa = h
        .node
        .sysfs
        .join("class/infiniband")
        .join(&efa.ibdev)
        .join("device/numa_node");
    std::fs::remove_file(&numa).unwrap();
    std::fs::create_dir(&numa).unwrap();
    h.scrape_until("a numa_node scan error", |t| {
        sample(
            t,
            "efa_device_plugin_scan_errors_total{reason=\"numa_node\"}",
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    let log = h.plugin_log();
    assert_eq!(
        log.matches("cannot read an EFA's NUMA node").count(),
        1,
        "{log}"
    );
    assert!(log.contains(&efa.ibdev), "{log}");
    // Topology is a hint: the device stays in service.
    assert_eq!(
        h.kubelet.view().borrow().health_of(&efa.ibdev),
        Some(HEALTHY)
    );
}

/// The plugin in cdi mode with an NFD feature file, both inside the harness: (spec, NFD file).
fn spawn_with_host_files(h: &mut Harness) -> (PathBuf, PathBuf) {
    let spec_dir = h.root.path().join("cdi");
    let nfd = h.root.path().join("features.d").join("efa");
    let (dir_arg, nfd_arg) = (spec_dir.display().to_string(), nfd.display().to_string());
    h.spawn_plugin(&[
        "--device-list-strategy",
        "cdi",
        "--cdi-spec-dir",
        &dir_arg,
        "--nfd-features-file",
        &nfd_arg,
    ]);
    (spec_dir.join("vpc.amazonaws.com-efa.json"), nfd)
}

#[tokio::test]
async fn host_files_are_world_readable_and_written_again_when_removed_or_edited() {
    let mut h = Harness::new(Shape::P4d);
    let (spec, nfd) = spawn_with_host_files(&mut h);
    h.registered().await;
    // NFD's worker reads as uid 65534; CDI readers need not be root.
    let world_readable = |path: &PathBuf| {
        let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "{}: {mode:o}", path.display());
    };
    for path in [&spec, &nfd] {
        eventually("the file", || path.exists()).await;
        world_readable(path);
        let text = std::fs::read_to_string(path).unwrap();
        let mut rewrites = Vec::new();
        for round in 0..5 {
            if round % 2 == 0 {
                std::fs::remove_file(path).unwrap();
            } else {
                // Edited in place: the same inode, other text.
                std::fs::write(path, "{}").unwrap();
            }
            let started = Instant::now();
            eventually("the file written again", || {
                std::fs::read_to_string(path).is_ok_and(|now| now == text)
            })
            .await;
            rewrites.push(started.elapsed());
            world_readable(path);
        }
        rewrites.sort();
        println!(
            "{}: rewritten after a median of {:?} (rescan interval 200ms)",
            path.display(),
            rewrites[rewrites.len() / 2]
        );
    }
    let log = h.plugin_log();
    assert!(
        log.matches("was removed or changed by someone else")
            .count()
            >= 2,
        "each file's healing is logged\n{log}"
    );
    assert!(!log.contains("cannot write"), "{log}");
}

// pre_exec is the one way to give only the child a file size limit.
#[allow(unsafe_code)]
#[tokio::test]
async fn a_write_that_keeps_failing_is_logged_once_though_each_temp_file_has_a_new_name() {
    // A file size limit under the spec's size stands in for a full disk: each attempt writes
    // a new temp file, whose random name is in the error (EFBIG here, ENOSPC on a full disk).
    // The log stays far below the limit.
    const LIMIT: u64 = 128 << 10;
    let mut h = Harness::new(Shape::P5);
    let dir = h.root.path().join("cdi").display().to_string();
    let args = [
        "--device-list-strategy",
        "cdi",
        "--cdi-spec-dir",
        &dir,
        "--sharing-replicas",
        "64",
    ];
    h.spawn_plugin_with(&args, |command| {
        // SAFETY: setrlimit and sigaction are async-signal-safe and touch only the child.
        unsafe {
            command.pre_exec(|| {
                use nix::sys::signal::{SigHandler, Signal, signal};
                // Ignored, the signal leaves write() to fail with EFBIG instead of killing.
                signal(Signal::SIGXFSZ, SigHandler::SigIgn).map_err(std::io::Error::from)?;
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_FSIZE,
                    LIMIT,
                    LIMIT,
                )
                .map_err(std::io::Error::from)
            });
        }
    });
    h.wait("registration", |v| v.stream_open && !v.devices.is_empty())
        .await;
    let failures = "efa_device_plugin_cdi_spec_write_failures_total";
    h.scrape_until("five failed writes", |text| {
        sample(text, failures).is_some_and(|n| n >= 5.0)
    })
    .await;
    let log = h.plugin_log();
    assert!(log.contains("File too large"), "{log}");
    assert_eq!(
        log.matches("cannot write the CDI spec").count(),
        1,
        "one line for the streak\n{log}"
    );
}

#[tokio::test]
async fn a_closed_stderr_pipe_never_ends_the_plugin() {
    let mut h = Harness::new(Shape::P4d);
    // A pipe whose reader is gone: every log line fails with EPIPE, from the first.
    let (reader, writer) = nix::unistd::pipe().unwrap();
    drop(reader);
    h.spawn_plugin_with(&["--log-format", "json"], |command| {
        command.stderr(std::fs::File::from(writer));
    });
    h.registered().await;
    let (status, _) = h.terminate_plugin();
    assert!(status.success(), "{status:?}");
    assert!(!h.plugin_socket().exists());
}

#[tokio::test]
async fn sighup_stops_the_plugin_like_sigterm_with_its_clean_up() {
    let mut h = Harness::new(Shape::P4d);
    let (_, nfd) = spawn_with_host_files(&mut h);
    h.registered().await;
    eventually("the NFD file", || nfd.exists()).await;
    let (status, _) = h.stop_plugin(nix::sys::signal::Signal::SIGHUP);
    assert!(status.success(), "{status:?}\n{}", h.plugin_log());
    assert!(!h.plugin_socket().exists(), "socket left behind");
    assert!(!nfd.exists(), "NFD file left behind");
    assert!(h.plugin_log().contains("stopping on signal"));
}

/// Threads of `pid` blocked connecting to a Unix socket whose backlog is full; 0 where the
/// kernel does not tell.
fn threads_in_connect(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .filter(|task| {
                    std::fs::read_to_string(task.path().join("wchan"))
                        .is_ok_and(|wchan| wchan == "unix_wait_for_peer")
                })
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn a_frozen_competitor_costs_no_thread_per_pass_and_the_plugin_keeps_serving() {
    let mut h = Harness::new(Shape::P4d);
    // The AWS plugin's socket, listening but never accepting.
    let _frozen = FrozenSocket::bind(&h.plugin_dir.join("aws-efa-device-plugin.sock")).unwrap();
    let pid = h.spawn_plugin(&[]);
    h.registered().await;
    let (_, before) = fds_and_tasks(pid);

    // A pass every 200 ms, and one on each change in the dir.
    let churn = h.plugin_dir.join("churn");
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        std::fs::write(&churn, "").unwrap();
        std::fs::remove_file(&churn).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, after) = fds_and_tasks(pid);
    let stuck = threads_in_connect(pid);
    eprintln!("threads: {before} before, {after} after 8 s of passes; {stuck} in connect");
    assert_eq!(stuck, 0, "threads hang in connect");
    // Blocking-pool threads that idle come and go; one left per pass would be 4 or more.
    assert!(
        after <= before + 2,
        "{before} threads before, {after} after"
    );

    assert_eq!(h.get("/healthz").await.0, 200);
    let efa = h.efas()[0].clone();
    h.node.remove_node(&efa).unwrap();
    let id = efa.ibdev.clone();
    h.wait("the removed node reported", |v| {
        v.health_of(&id) == Some(UNHEALTHY)
    })
    .await;
    let (status, took) = h.terminate_plugin();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(2), "SIGTERM took {took:?}");
}

#[tokio::test]
async fn a_plugins_registry_that_cannot_be_listed_keeps_the_devices_withheld() {
    let mut h = Harness::new(Shape::P4d);
    let registry = h.root.path().join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let socket = registry.join("dra.net-reg.sock");
    let dranet = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    h.spawn_plugin(&[]);
    h.wait("every device withheld", |v| {
        v.stream_open && v.devices.len() == 4 && v.healthy() == 0
    })
    .await;

    let aside = h.root.path().join("plugins_registry.aside");
    std::fs::rename(&registry, &aside).unwrap();
    // Not a directory: ENOTDIR, no evidence that the driver went.
    std::fs::write(&registry, "").unwrap();
    // Five passes at the harness's 200 ms.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let healthy = h.kubelet.view().borrow().healthy();
    assert_eq!(
        healthy, 0,
        "{healthy} EFAs turned Healthy: the guard failed open"
    );
    let log = h.plugin_log();
    assert_eq!(
        log.matches("cannot list the plugins_registry dir").count(),
        1,
        "logged once while it lasts\n{log}"
    );

    std::fs::remove_file(&registry).unwrap();
    std::fs::rename(&aside, &registry).unwrap();
    drop(dranet);
    std::fs::remove_file(&socket).unwrap();
    h.wait("devices back", |v| v.healthy() == 4).await;
    assert!(h.plugin_log().contains("can be listed again"));
}
