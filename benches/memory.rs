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

use efa_device_plugin::proto::deviceplugin::{
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
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
            name: "489 EFAs x64, cdi, after a flap (cdi's most)",
            run: || Box::pin(flap(489, 64, true)),
        },
        Scenario {
            name: "1,780 EFAs x17, cdi, after a flap (cdi's most)",
            run: || Box::pin(flap(1780, 17, true)),
        },
        Scenario {
            name: "489 EFAs x64, cdi, every replica held, a flap and a GPA",
            run: || Box::pin(held(489, 64)),
        },
        Scenario {
            name: "a 3.9 MiB answer: one container, one ID 340,000 times",
            run: || Box::pin(hostile_answer(340_000)),
        },
        Scenario {
            name: "256 EFAs x64, 16 concurrent GPAs of 4,096 of 8,192 IDs",
            run: || Box::pin(concurrent_gpa(16)),
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
    match flapped(&mut h, replicas, cdi).await {
        Ok(ids) => peak(h, format!("{ids} IDs")),
        Err(refused) => refused,
    }
}

/// [`flap`] in cdi mode with `replicas` pods, each holding one replica of every EFA with the
/// longest names, so every ID is held; then a GetPreferredAllocation of 8,192 of them.
async fn held(efas: u32, replicas: u32) -> Outcome {
    let mut h = Harness::new(Shape::Dense(efas));
    let devices: Vec<FakeDevice> = h.efas().into_iter().cloned().collect();
    let pods = support::pods_holding_every_efa(&devices, replicas as usize);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _stub = PodResourcesStub::start(&socket, pods).expect("PodResources stand-in");
    let ids = match flapped(&mut h, replicas, true).await {
        Ok(ids) => ids,
        Err(refused) => return refused,
    };
    let offered: Vec<String> = h.kubelet.view().borrow().devices[..8192]
        .iter()
        .map(|d| d.id.clone())
        .collect();
    assert_eq!(h.prefer(offered, 64).await.len(), 64);
    peak(h, format!("{ids} IDs, each held"))
}

/// One container listing one ID (an EFA's ibdev name) `times` times, with the longest names.
async fn hostile_answer(times: usize) -> Outcome {
    let mut h = Harness::new(Shape::P5);
    let ibdev = h.efas()[0].ibdev.clone();
    let listed = vec![ibdev.as_str(); times];
    let mut pods = support::pods_holding_every_efa(&[], 1);
    pods[0].containers[0].devices[0].device_ids =
        listed.iter().map(|id| (*id).to_owned()).collect();
    let bytes = prost::Message::encoded_len(&pods[0]);
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let _stub = PodResourcesStub::start(&socket, pods).expect("PodResources stand-in");
    h.spawn_plugin(&[]);
    h.registered().await;
    let address = h.metrics_address().await;
    let held = format!("efa_device_allocation{{device=\"{ibdev}\"");
    let mut attributed = false;
    for _ in 0..20 {
        let (_, text) = http_get(address, "/metrics").await;
        attributed = text.contains(&held);
        if attributed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // More polls, each decoding the answer again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    peak(
        h,
        format!(
            "{bytes}-byte answer; the holder {}",
            if attributed { "named" } else { "not named" }
        ),
    )
}

/// `calls` GetPreferredAllocation calls at once, each offering every other ID of 256 EFAs
/// shared 64 ways (8,192 IDs) for 4,096 of them.
async fn concurrent_gpa(calls: usize) -> Outcome {
    let mut h = Harness::new(Shape::Dense(256));
    h.spawn_plugin(&["--sharing-replicas", "64"]);
    let ids = 256 * 64;
    let view = h
        .wait("registration", |v| v.stream_open && v.devices.len() == ids)
        .await;
    let offered: Vec<String> = view
        .devices
        .iter()
        .step_by(2)
        .map(|d| d.id.clone())
        .collect();
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..calls {
        let mut client = h.kubelet.plugin().expect("plugin connection");
        let request = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: offered.clone(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: 4096,
            }],
        };
        set.spawn(async move { client.get_preferred_allocation(request).await });
    }
    for answer in set.join_all().await {
        let answer = answer.expect("GetPreferredAllocation").into_inner();
        assert_eq!(answer.container_responses[0].device_i_ds.len(), 4096);
    }
    let took = started.elapsed();
    peak(h, format!("{calls} answers in {:.1} s", took.as_secs_f64()))
}

/// The plugin's peak so far; ends it.
fn peak(mut h: Harness, detail: String) -> Outcome {
    let kib = status_kib(h.plugin_pid(), "VmHWM");
    h.terminate_plugin();
    Outcome::Peak { kib, detail }
}

/// Registers `h`'s plugin with `replicas` per EFA, then removes every device node and restores
/// them; the number of IDs, or the refusal at start.
async fn flapped(h: &mut Harness, replicas: u32, cdi: bool) -> Result<usize, Outcome> {
    let efas = h.efas().len();
    let replicas_arg = replicas.to_string();
    let cdi_dir = h.root.path().join("cdi").display().to_string();
    let mut args = vec!["--sharing-replicas", &replicas_arg];
    if cdi {
        args.extend(["--device-list-strategy", "cdi", "--cdi-spec-dir", &cdi_dir]);
    }
    h.spawn_plugin(&args);
    let ids = efas * replicas as usize;
    let started = Instant::now();
    loop {
        if h.kubelet.view().borrow().devices.len() == ids {
            break;
        }
        if let Some(line) = exited(h) {
            return Err(Outcome::Refused(line));
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
    Ok(ids)
}

/// The plugin's last log line if it has exited.
fn exited(h: &mut Harness) -> Option<String> {
    h.plugin_exited()?;
    Some(h.plugin_log().lines().last().unwrap_or_default().to_owned())
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}
