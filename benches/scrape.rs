//! What observability costs: a `/metrics` scrape of a p5.48xlarge (32 EFAs, 19 counters each),
//! and Allocate latency with and without a scraper hammering the endpoint.
//!
//! The plugin runs as in production, on its own single-threaded runtime; the kubelet stand-in
//! and the clients run on another thread. Run with `cargo bench --bench scrape`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use efa_device_plugin::app::Plugin;
use efa_device_plugin::config::Settings;
use efa_device_plugin::kubelet_stub::KubeletStub;
use efa_device_plugin::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use efa_device_plugin::simulate::{FakeNode, Nodes, Shape};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const SCRAPES: usize = 300;
const ALLOCATIONS: usize = 2000;
/// The budget a scrape of 32 devices must stay under (median).
const SCRAPE_BUDGET: Duration = Duration::from_millis(2);

fn main() {
    let root = tempfile::tempdir().expect("scratch dir");
    let (node, devices) = FakeNode::build(root.path(), Shape::P5, Nodes::Files).expect("p5 node");
    for (i, device) in devices.iter().enumerate() {
        node.set_port_counter(device, "tx_bytes", 1_000_000 * i as u64)
            .expect("counter");
    }
    let plugin_dir = root.path().join("device-plugins");
    let address = free_loopback_port();
    let settings = Settings {
        sysfs_root: node.sysfs.clone(),
        dev_root: node.dev.clone(),
        device_plugin_dir: plugin_dir.clone(),
        metrics_address: Some(address),
        pod_resources_socket: root.path().join("pod-resources/kubelet.sock"),
        plugins_registry_dir: root.path().join("plugins_registry"),
        ..Settings::default()
    };

    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let kubelet = clients
        .block_on(async { KubeletStub::start(&plugin_dir) })
        .expect("kubelet");

    let shutdown = CancellationToken::new();
    let plugin_thread = std::thread::spawn({
        let shutdown = shutdown.clone();
        move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("plugin runtime")
                .block_on(Plugin::new().run(&settings, shutdown))
                .expect("plugin");
        }
    });

    let rows = clients.block_on(async {
        kubelet
            .wait_for(Duration::from_secs(10), |v| {
                v.stream_open && v.healthy() == devices.len()
            })
            .await
            .expect("registration");
        let id = devices[0].bdf.clone();
        let text = get(address, "/metrics").await;
        let series = text
            .lines()
            .filter(|l| l.starts_with("efa_") && !l.starts_with("efa_device_plugin"))
            .count();

        let scrape = summary(
            &timed(SCRAPES, || async {
                get(address, "/metrics").await;
            })
            .await,
        );
        let quiet = summary(&allocations(&kubelet, &id).await);

        let stop = Arc::new(AtomicBool::new(false));
        let scraped = Arc::new(AtomicUsize::new(0));
        let scraper = std::thread::spawn({
            let (stop, scraped) = (stop.clone(), scraped.clone());
            move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("scraper runtime")
                    .block_on(async {
                        while !stop.load(Ordering::Relaxed) {
                            get(address, "/metrics").await;
                            scraped.fetch_add(1, Ordering::Relaxed);
                        }
                    })
            }
        });
        let busy = summary(&allocations(&kubelet, &id).await);
        stop.store(true, Ordering::Relaxed);
        scraper.join().expect("scraper");

        println!(
            "p5.48xlarge: {} EFAs, {series} counter series per scrape, {} bytes",
            devices.len(),
            text.len()
        );
        println!(
            "{} scrapes ran during the second Allocate run\n",
            scraped.load(Ordering::Relaxed)
        );
        vec![
            ("GET /metrics (32 EFAs)", scrape),
            ("Allocate, no scrapes", quiet),
            ("Allocate, scraped non-stop", busy),
        ]
    });

    println!("{:<28} {:>10} {:>10} {:>10}", "", "median", "p90", "p99");
    for (name, s) in &rows {
        println!(
            "{name:<28} {:>10} {:>10} {:>10}",
            micros(s.median),
            micros(s.p90),
            micros(s.p99)
        );
    }
    let verdict = if rows[0].1.median <= SCRAPE_BUDGET {
        "within"
    } else {
        "OVER"
    };
    println!("\nscrape median {verdict} the {SCRAPE_BUDGET:?} budget");

    shutdown.cancel();
    plugin_thread.join().expect("plugin thread");
}

struct Summary {
    median: Duration,
    p90: Duration,
    p99: Duration,
}

fn summary(samples: &[Duration]) -> Summary {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    Summary {
        median: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
}

fn micros(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

async fn timed<F, Fut>(n: usize, mut run: F) -> Vec<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        run().await;
        samples.push(started.elapsed());
    }
    samples
}

async fn allocations(kubelet: &KubeletStub, id: &str) -> Vec<Duration> {
    let client = kubelet.plugin().expect("plugin connection");
    timed(ALLOCATIONS, || {
        let mut client = client.clone();
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![id.to_owned()],
            }],
        };
        async move {
            client.allocate(request).await.expect("allocate");
        }
    })
    .await
}

/// A port nobody listens on right now; the plugin's flag takes an address, not a listener.
fn free_loopback_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("loopback");
    listener.local_addr().expect("address")
}

/// One GET on a fresh connection, as a scraper without keep-alive would do it.
async fn get(address: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("response");
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    body.to_owned()
}
