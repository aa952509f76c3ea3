//! Peak memory (VmHWM) of the release binary under the loads that decide whether it fits in the
//! pod's 64 MiB limit: concurrent scrapes with the longest pod names Kubernetes accepts, many
//! ListAndWatch streams, and the densest device list the start-up checks accept, through a flap
//! of every device.
//!
//! Each run starts a fresh plugin process; a scenario's figure is the median of [`RUNS`].
//! `EFA_DP_HARNESS_BINARY=PATH` measures another build of the plugin instead of this one.
//! 1,780 EFAs are the most whose list at 64 replicas fits the kubelet's message limit.
//! Everything stays on loopback and Unix sockets. Run with `cargo bench --bench memory`;
//! `cargo bench --bench memory -- NAME` runs the scenarios whose name contains NAME.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use efa_device_plugin::testkit::pod_resources_stub::PodResourcesStub;
use efa_device_plugin::testkit::simulate::{FakeDevice, Shape};
use support::{Harness, http_get, status_kib};

const RUNS: usize = 3;
/// The pod's memory limit in the shipped manifests.
const POD_LIMIT_KIB: u64 = 64 * 1024;

fn main() {
    let filter = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with('-'))
        .unwrap_or_default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    println!("VmHWM of the plugin, median of {RUNS} runs; the pod's limit is 64 MiB\n");
    for scenario in scenarios() {
        if !scenario.name.contains(&filter) {
            continue;
        }
        let mut peaks = Vec::new();
        let mut note = String::new();
        for _ in 0..RUNS {
            match runtime.block_on((scenario.run)()) {
                Outcome::Peak { kib, detail } => {
                    peaks.push(kib);
                    note = detail;
                }
                Outcome::Refused(line) => {
                    note = format!("refused at start: {line}");
                    break;
                }
            }
        }
        let figure = if peaks.is_empty() {
            "—".to_owned()
        } else {
            peaks.sort_unstable();
            let median = peaks[peaks.len() / 2];
            let verdict = if median < POD_LIMIT_KIB {
                "within"
            } else {
                "OVER"
            };
            format!(
                "{} (runs {}) {verdict} the limit",
                mib(median),
                peaks.iter().map(|&k| mib(k)).collect::<Vec<_>>().join(", ")
            )
        };
        println!("{:<44} {figure}\n    {note}", scenario.name);
    }
}

enum Outcome {
    Peak {
        kib: u64,
        detail: String,
    },
    /// The plugin refused the setting at start; the line it printed.
    Refused(String),
}

struct Scenario {
    name: &'static str,
    run: fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Outcome>>>,
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "p5 x64, 64 pods x 32 IDs, 8 concurrent scrapes",
            run: || Box::pin(scrapes(8)),
        },
        Scenario {
            name: "p5 x64, 64 pods x 32 IDs, 64 concurrent scrapes",
            run: || Box::pin(scrapes(64)),
        },
        Scenario {
            name: "p5 x64, 100 ListAndWatch streams",
            run: || Box::pin(streams(100)),
        },
        Scenario {
            name: "1,780 EFAs x64, device-specs, after a flap",
            run: || Box::pin(flap(1780, 64, false)),
        },
        Scenario {
            name: "1,780 EFAs x64, cdi, after a flap",
            run: || Box::pin(flap(1780, 64, true)),
        },
        Scenario {
            name: "721 EFAs x64, cdi, after a flap (cdi's most)",
            run: || Box::pin(flap(721, 64, true)),
        },
        Scenario {
            name: "1,780 EFAs x25, cdi, after a flap (cdi's most)",
            run: || Box::pin(flap(1780, 25, true)),
        },
    ]
}

/// 64 pods, each holding one replica of every EFA of a p5 shared 64 ways, so every EFA has 64
/// holders, all with the longest names; then `concurrent` scrapes at once, five times over.
async fn scrapes(concurrent: usize) -> Outcome {
    let mut h = Harness::new(Shape::P5);
    let efas: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let pods = support::pods_holding_every_efa(&efas, 64);
    let first_pod = pods[0].name.clone();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _stub = PodResourcesStub::start(&socket, pods).expect("PodResources stand-in");
    h.spawn_plugin(&["--sharing-replicas", "64", "--rescan-interval", "5s"]);
    let ids = efas.len() * 64;
    h.wait("registration", |v| v.stream_open && v.devices.len() == ids)
        .await;
    let address = h.metrics_address().await;
    let (mut bytes, mut attributed) = (0, 0);
    for _ in 0..5 {
        // The last round's slots are given back once the plugin has closed its connections.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..concurrent {
            set.spawn(http_get(address, "/metrics"));
        }
        for (status, text) in set.join_all().await {
            assert_eq!(status, 200);
            // The kubelet's answer has a deadline: a scrape past it has no pod names.
            if text.contains(&first_pod) {
                attributed += 1;
                bytes = bytes.max(text.len());
            }
        }
    }
    let kib = status_kib(h.plugin_pid(), "VmHWM");
    h.terminate_plugin();
    Outcome::Peak {
        kib,
        detail: format!(
            "{bytes} bytes per scrape; {attributed} of {} scrapes named the pods",
            5 * concurrent
        ),
    }
}

/// `streams` ListAndWatch streams besides the kubelet's, each on its own connection, each
/// reading the list; then one device fails and every open stream reads the new list.
async fn streams(streams: usize) -> Outcome {
    let mut h = Harness::new(Shape::P5);
    h.spawn_plugin(&["--sharing-replicas", "64"]);
    let ids = h.efas().len() * 64;
    h.wait("registration", |v| v.stream_open && v.devices.len() == ids)
        .await;
    let mut open = Vec::new();
    let mut refused = 0;
    for _ in 0..streams {
        match support::open_list_stream(&h).await {
            Ok((stream, list)) => {
                assert_eq!(list.devices.len(), ids);
                open.push(stream);
            }
            Err(_) => refused += 1,
        }
    }
    let failed = h.efas()[0].clone();
    h.node.remove_node(&failed).expect("remove node");
    let deadline = Instant::now() + support::TIMEOUT;
    for stream in &mut open {
        let left = deadline.saturating_duration_since(Instant::now());
        let list = tokio::time::timeout(left, stream.message())
            .await
            .expect("the new list in time")
            .expect("stream")
            .expect("a list");
        assert!(list.devices.iter().any(|d| d.health == "Unhealthy"));
    }
    let kib = status_kib(h.plugin_pid(), "VmHWM");
    h.terminate_plugin();
    Outcome::Peak {
        kib,
        detail: format!(
            "{} streams held open and served twice, {refused} refused",
            open.len()
        ),
    }
}

/// `efas` EFAs shared `replicas` ways: registered, then every device node removed (every ID
/// Unhealthy) and restored (every ID Healthy again), the kubelet reading each list.
async fn flap(efas: u32, replicas: u32, cdi: bool) -> Outcome {
    let mut h = Harness::new(Shape::Dense(efas));
    let replicas_arg = replicas.to_string();
    let cdi_dir = h.root.path().join("cdi").display().to_string();
    let mut args = vec!["--sharing-replicas", &replicas_arg];
    if cdi {
        args.extend(["--device-list-strategy", "cdi", "--cdi-spec-dir", &cdi_dir]);
    }
    h.spawn_plugin(&args);
    let ids = (efas * replicas) as usize;
    let started = Instant::now();
    loop {
        if h.kubelet.view().borrow().devices.len() == ids {
            break;
        }
        if let Some(line) = exited(&mut h) {
            return Outcome::Refused(line);
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no registration\n{}",
            h.plugin_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let devices: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    for device in &devices {
        h.node.remove_node(device).expect("remove node");
    }
    h.wait("every ID unhealthy", |v| {
        v.snapshots > 1 && v.healthy() == 0
    })
    .await;
    for device in &devices {
        h.node.create_node(device).expect("create node");
    }
    h.wait("every ID healthy again", |v| v.healthy() == ids)
        .await;
    // Let the file writer and the streams settle on the last list.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let kib = status_kib(h.plugin_pid(), "VmHWM");
    h.terminate_plugin();
    Outcome::Peak {
        kib,
        detail: format!("{ids} IDs"),
    }
}

/// The plugin's last log line if it has exited.
fn exited(h: &mut Harness) -> Option<String> {
    h.plugin_exited()?;
    Some(h.plugin_log().lines().last().unwrap_or_default().to_owned())
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}
