//! Registration under pressure, against the real binary: a kubelet socket that is not listening
//! yet, a kubelet that rejects every stream, foreign streams, a second instance, the socket's
//! mode, the kubelet's message size limit, and a heavy GetPreferredAllocation.

mod support;

use std::io::{Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use efa_device_plugin::discovery::DevNum;
use efa_device_plugin::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest, device_plugin_client::DevicePluginClient,
};
use efa_device_plugin::testkit::simulate::Shape;
use support::{BINARY, Harness, TIMEOUT, eventually};
use tokio::task::JoinHandle;

fn occurrences(log: &str, needle: &str) -> usize {
    log.lines().filter(|line| line.contains(needle)).count()
}

/// Runs the plugin with `args` until it exits: its status and stderr. Fails the test if it is
/// still running after [`TIMEOUT`].
async fn exit_of(args: &[String]) -> (ExitStatus, String) {
    // A file, not a pipe: nobody reads a pipe while waiting, and a full one would block the log.
    let mut stderr = tempfile::tempfile().unwrap();
    let mut plugin = Command::new(BINARY)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr.try_clone().unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = plugin.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = plugin.kill();
            let _ = plugin.wait();
            panic!("the plugin kept running");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stderr.seek(SeekFrom::Start(0)).unwrap();
    (status, std::io::read_to_string(stderr).unwrap())
}

#[tokio::test]
async fn a_kubelet_socket_that_listens_late_is_registered_with_at_once() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered_and_logged().await;
    let calls = h.kubelet.view().borrow().register_calls;
    // The plugin sees kubelet.sock appear and connects before the kubelet listens; the old
    // backoff would have retried 100, 300 and 700 ms later, and then at 1.5 s.
    h.kubelet
        .restart_listening_after(Duration::from_millis(800))
        .await
        .unwrap();
    let listening = Instant::now();
    h.wait("re-registration", |v| {
        v.register_calls > calls && v.stream_open
    })
    .await;
    let took = listening.elapsed();
    let log = h.plugin_log();
    assert_eq!(
        occurrences(&log, "registration with the kubelet failed"),
        0,
        "a refused connect within the grace period is no failure\n{log}"
    );
    // Generous against scheduling noise, still far below the 700 ms the old backoff took.
    assert!(took < Duration::from_millis(400), "took {took:?}\n{log}");
}

#[tokio::test]
async fn a_kubelet_that_clears_the_dir_while_the_plugin_dials_it_is_registered_with_at_once() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    h.registered_and_logged().await;
    // The plugin serves a new socket and dials the old kubelet.sock while the kubelet is down;
    // the new kubelet's start-up cleanup then deletes that socket, so its dial-back would fail
    // and Register hang for 10 s unless the plugin notices and serves the socket again.
    h.kubelet
        .restart_after(Duration::from_millis(300))
        .await
        .unwrap();
    let up = Instant::now();
    h.wait("a healthy device list", |v| {
        v.stream_open && v.healthy() == 4
    })
    .await;
    let took = up.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "took {took:?}\n{}",
        h.plugin_log()
    );
}

#[tokio::test]
async fn a_kubelet_that_keeps_ending_streams_gets_growing_pauses_and_few_log_lines() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet.reject_streams(true);
    h.spawn_plugin(&[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let calls = h.kubelet.view().borrow().register_calls;
    let log = h.plugin_log();
    // Pauses of 0, 0.1, 0.2, 0.4, 0.8 and 1.6 s: about 6 registrations in 3 s, where an
    // immediate retry makes hundreds.
    assert!((3..=10).contains(&calls), "{calls} registrations\n{log}");
    assert_eq!(
        occurrences(&log, "keeps ending the ListAndWatch stream"),
        1,
        "{log}"
    );
    assert!(
        occurrences(&log, "registered with the kubelet") <= 2,
        "{log}"
    );
    assert!(occurrences(&log, "registration ended") <= 1, "{log}");

    h.kubelet.reject_streams(false);
    h.registered().await;
    eventually("the end of the backoff to be logged", || {
        h.plugin_log().contains("backoff over")
    })
    .await;
    // Back to normal: the next ending re-registers at once.
    let started = h.kubelet.view().borrow().streams_started;
    h.kubelet.end_stream();
    h.wait("re-registration", |v| {
        v.streams_started > started && v.stream_open
    })
    .await;
}

#[tokio::test]
async fn a_kubelet_that_keeps_refusing_register_is_logged_once_per_state_change() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet
        .refuse_registrations(Some("the kubelet is draining"));
    let started = Instant::now();
    h.spawn_plugin(&[]);
    // Pauses of 0.1, 0.2, ... doubling to 5 s: 7 attempts take about 6.3 s; after that the
    // pace is one attempt per 5 s, 720 an hour.
    h.wait("seven refused registrations", |v| v.register_calls >= 7)
        .await;
    let seen = started.elapsed();
    let log = h.plugin_log();
    let failures = occurrences(&log, "registration with the kubelet failed");
    println!("7 refused attempts in {seen:?}: {failures} warn lines");
    assert_eq!(failures, 1, "one line for the refusal\n{log}");

    // Another reason is another state: one more line.
    h.kubelet
        .refuse_registrations(Some("the kubelet is out of memory"));
    let calls = h.kubelet.view().borrow().register_calls;
    h.wait("another refused registration", |v| {
        v.register_calls > calls && v.last_error.as_deref() == Some("the kubelet is out of memory")
    })
    .await;
    eventually("the line for the new error", || {
        occurrences(&h.plugin_log(), "out of memory") == 1
    })
    .await;
    let log = h.plugin_log();
    assert_eq!(
        occurrences(&log, "registration with the kubelet failed"),
        2,
        "{log}"
    );

    h.kubelet.refuse_registrations(None);
    h.registered().await;
    eventually("the recovery line", || {
        h.plugin_log().contains("registered with the kubelet")
    })
    .await;
}

#[tokio::test]
async fn a_kubelet_that_accepts_register_but_opens_no_stream_is_registered_with_again() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet.open_no_streams(true);
    h.spawn_plugin(&[]);
    h.wait("a second registration", |v| v.register_calls >= 2)
        .await;
    assert_eq!(h.kubelet.view().borrow().streams_started, 0);
    h.kubelet.open_no_streams(false);
    h.registered().await;
    let log = h.plugin_log();
    assert_eq!(
        occurrences(&log, "opened no ListAndWatch stream"),
        1,
        "one line for the streak\n{log}"
    );
    let (status, _) = h.get("/readyz").await;
    assert_eq!(status, 200, "{log}");
}

#[tokio::test]
async fn another_clients_stream_ending_keeps_the_registration() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    let before = h.registered_and_logged().await;
    let channel = efa_device_plugin::uds::dial(&h.plugin_socket())
        .await
        .unwrap();
    let mut stream = DevicePluginClient::new(channel)
        .list_and_watch(Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    drop(stream);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = h.kubelet.view().borrow().clone();
    let log = h.plugin_log();
    assert_eq!(after.register_calls, before.register_calls, "{log}");
    assert!(after.stream_open, "{log}");
    assert!(!log.contains("registration ended"), "{log}");
}

#[tokio::test]
async fn the_plugin_socket_is_0600_whatever_the_umask() {
    let mut h = Harness::new(Shape::P4d);
    // Inherited by the plugin; this test binary's own files do not care.
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    h.spawn_plugin(&[]);
    h.registered().await;
    let mode = std::fs::symlink_metadata(h.plugin_socket())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
}

#[tokio::test]
async fn a_second_instance_on_the_same_dir_exits_with_a_clear_message() {
    let mut h = Harness::new(Shape::P4d);
    h.spawn_plugin(&[]);
    let before = h.registered_and_logged().await;
    let (status, stderr) = exit_of(&h.args()).await;
    assert!(!status.success(), "{stderr}");
    // The log goes to stderr too; the reason is the last line, whole.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("another efa-device-plugin is running"),
        "{stderr}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = h.kubelet.view().borrow().clone();
    assert_eq!(after.register_calls, before.register_calls);
    assert!(after.stream_open && h.plugin_socket().exists());
}

#[tokio::test]
async fn a_sharing_count_over_the_kubelets_message_limit_is_refused_at_start() {
    let h = Harness::new(Shape::NoEfa);
    // 2048 EFAs at 64 replicas make about 4.6 MB of device list; the kubelet takes 4 MiB.
    let template = efa_device_plugin::testkit::simulate::devices(Shape::P4d).remove(0);
    for n in 0..2048u32 {
        let (domain, bus) = (n / 256, n % 256);
        let device = efa_device_plugin::testkit::simulate::FakeDevice {
            bdf: format!("{domain:04x}:{bus:02x}:00.0"),
            parents: vec![format!("pci{domain:04x}:{bus:02x}")],
            ibdev: format!("rdmaP{domain}p{bus}s0"),
            uverbs: n,
            dev: DevNum {
                major: 511,
                minor: n,
            },
            ..template.clone()
        };
        h.node.add(&device).unwrap();
    }
    let mut args = h.args();
    // PCI addresses: the longer of the two ID forms on this tree.
    args.extend(["--sharing-replicas", "64", "--device-id-strategy", "pci"].map(String::from));
    let (status, stderr) = exit_of(&args).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("--sharing-replicas") && last.contains("at most 58 fit"),
        "{stderr}"
    );
    assert!(!h.plugin_socket().exists());
    assert_eq!(h.kubelet.view().borrow().register_calls, 0);
}

#[tokio::test]
async fn the_largest_preferred_allocation_does_not_hold_up_allocate_or_the_probes() {
    let mut h = Harness::new(Shape::Dense256);
    h.spawn_plugin(&["--sharing-replicas", "64"]);
    let view = h
        .wait("registration with 16384 IDs", |v| {
            v.stream_open && v.devices.len() == 256 * 64
        })
        .await;
    let all: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let address = h.metrics_address().await;
    let mut client = h.kubelet.plugin().unwrap();
    let mut heavy = client.clone();
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: all.clone(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: 4096,
        }],
    };
    let preferring = tokio::spawn(async move {
        let started = Instant::now();
        heavy.get_preferred_allocation(request).await.unwrap();
        started.elapsed()
    });
    // Let the request arrive and its answer start.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: all[..8].to_vec(),
            }],
        })
        .await
        .unwrap();
    let (status, _) = support::http_get(address, "/healthz").await;
    let answered = started.elapsed();
    assert_eq!(status, 200);
    let preferred_first = preferring.is_finished();
    let preferred = preferring.await.unwrap();
    assert!(
        !preferred_first,
        "GetPreferredAllocation finished first, in {preferred:?}: the test needs a larger one"
    );
    assert!(
        answered < preferred / 2,
        "Allocate and /healthz took {answered:?} during a {preferred:?} GetPreferredAllocation"
    );
}

/// Another root client on the node: as soon as the kubelet has been sent each Register, it
/// opens a ListAndWatch stream of its own on the plugin's socket and keeps it open. Counts the
/// streams that got their first list.
fn open_a_stream_after_each_register(h: &Harness) -> (JoinHandle<()>, Arc<AtomicUsize>) {
    let mut view = h.kubelet.view();
    let socket = h.plugin_socket();
    let opened = Arc::new(AtomicUsize::new(0));
    let counted = opened.clone();
    let client = tokio::spawn(async move {
        let mut held = Vec::new();
        let mut seen = 0;
        while let Ok(calls) = view
            .wait_for(|v| v.register_calls > seen)
            .await
            .map(|v| v.register_calls)
        {
            seen = calls;
            let Ok(channel) = efa_device_plugin::uds::dial(&socket).await else {
                continue;
            };
            let Ok(response) = DevicePluginClient::new(channel)
                .list_and_watch(Empty {})
                .await
            else {
                continue;
            };
            let mut stream = response.into_inner();
            if stream.message().await.is_ok_and(|list| list.is_some()) {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        }
    });
    (client, opened)
}

#[tokio::test]
async fn a_foreign_stream_opened_right_after_register_cannot_hide_a_missing_kubelet_stream() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet.open_no_streams(true);
    let (client, opened) = open_a_stream_after_each_register(&h);
    h.spawn_plugin(&[]);
    h.wait("a second registration", |v| v.register_calls >= 2)
        .await;
    assert!(opened.load(Ordering::SeqCst) >= 1, "no foreign stream");
    assert_eq!(h.kubelet.view().borrow().streams_started, 0);

    // With a foreign stream beside it, the kubelet's own is still told apart.
    h.kubelet.open_no_streams(false);
    let registered = h.registered().await;
    tokio::time::sleep(Duration::from_millis(5500)).await;
    let view = h.kubelet.view().borrow().clone();
    let log = h.plugin_log();
    assert_eq!(view.register_calls, registered.register_calls, "{log}");
    assert!(view.stream_open, "{log}");
    assert_eq!(
        occurrences(&log, "opened no ListAndWatch stream"),
        1,
        "one line for the streak\n{log}"
    );
    client.abort();
}

/// Node mode's boot: the service manager (systemd, `Type=notify`) starts the kubelet only after
/// the plugin says `READY=1`, which it says before any kubelet exists; the kubelet that then
/// starts is registered with at once, before it could admit a pod.
#[tokio::test]
async fn a_plugin_started_before_the_kubelet_says_ready_and_registers_as_the_kubelet_starts() {
    let mut h = Harness::new(Shape::P4d);
    h.kubelet.power_off().await;
    let notify = h.root.path().join("notify");
    let manager = tokio::net::UnixDatagram::bind(&notify).unwrap();
    h.spawn_plugin_with(&[], |plugin| {
        plugin.env("NOTIFY_SOCKET", &notify);
    });
    let mut said = [0u8; 256];
    let n = tokio::time::timeout(TIMEOUT, manager.recv(&mut said))
        .await
        .unwrap_or_else(|_| panic!("no READY=1 with no kubelet\n{}", h.plugin_log()))
        .unwrap();
    assert!(
        String::from_utf8_lossy(&said[..n]).starts_with("READY=1\n"),
        "{:?}",
        String::from_utf8_lossy(&said[..n])
    );
    assert!(!h.plugin_dir.join("kubelet.sock").exists());

    h.kubelet.restart().await.unwrap();
    let started = Instant::now();
    h.wait("registration", |v| v.stream_open && v.healthy() == 4)
        .await;
    let took = started.elapsed();
    // The kubelet admits its first pods after its runtime is up, a second or more after its
    // socket appears; generous against scheduling noise.
    assert!(
        took < Duration::from_millis(500),
        "took {took:?}\n{}",
        h.plugin_log()
    );

    let (status, _) = h.terminate_plugin();
    assert!(status.success());
    let n = tokio::time::timeout(TIMEOUT, manager.recv(&mut said))
        .await
        .expect("STOPPING=1 at shutdown")
        .unwrap();
    assert_eq!(&said[..n], b"STOPPING=1");
}
