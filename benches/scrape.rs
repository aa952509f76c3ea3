//! What observability costs: a `/metrics` scrape of a p5.48xlarge (32 EFAs, 21 counters each),
//! and Allocate latency with and without a scraper hammering the endpoint; and what a flood of
//! idle connections to the endpoint, ten times its connection cap, costs the plugin.
//!
//! The real binary runs as in production, one process on a single-threaded runtime; the kubelet
//! stand-in and the clients run in this process. Run with `cargo bench --bench scrape`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use efa_device_plugin::allocation::metrics::AllocationMetrics;
use efa_device_plugin::health::{self, ScanStats};
use efa_device_plugin::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use efa_device_plugin::proto::podresources::PodResources;
use efa_device_plugin::state::{DeviceState, StatusReader, Writer};
use efa_device_plugin::telemetry::counters::CounterFiles;
use efa_device_plugin::telemetry::fds::MAX_CONNECTIONS;
use efa_device_plugin::telemetry::metrics::Metrics;
use efa_device_plugin::testkit::kubelet_stub::KubeletStub;
use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, http_get, status_kib};

const SCRAPES: usize = 300;
const RESOURCE: &str = "vpc.amazonaws.com/efa";
const ALLOCATIONS: usize = 2000;
/// The budget a scrape of 32 devices must stay under (median).
const SCRAPE_BUDGET: Duration = Duration::from_millis(2);

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let rows = runtime.block_on(measure());
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
}

async fn measure() -> Vec<(&'static str, Summary)> {
    let mut h = Harness::new(Shape::P5);
    for (i, device) in h.efas().into_iter().enumerate() {
        h.node
            .set_port_counter(device, "tx_bytes", 1_000_000 * i as u64)
            .expect("counter");
    }
    // The production rescan interval, so rescans do not crowd the measurement.
    h.spawn_plugin(&["--rescan-interval", "5s"]);
    h.registered().await;
    let address = h.metrics_address().await;
    let id = h.efas()[0].ibdev.clone();
    let text = http_get(address, "/metrics").await.1;
    let series = text
        .lines()
        .filter(|l| l.starts_with("efa_") && !l.starts_with("efa_device_plugin"))
        .count();

    let scrape = summary(
        &timed(SCRAPES, || async {
            http_get(address, "/metrics").await;
        })
        .await,
    );
    // The same work in this process, to tell sysfs reads from encoding and HTTP.
    let pairs: Vec<(String, String)> = h
        .efas()
        .iter()
        .map(|d| (d.ibdev.clone(), d.ibdev.clone()))
        .collect();
    let files = CounterFiles::new(&h.node.sysfs);
    let read = summary(
        &timed(SCRAPES, || async {
            files.read(&pairs);
        })
        .await,
    );
    let state = DeviceState::unguarded();
    state.apply(
        health::observe(
            &h.node.sysfs,
            efa_device_plugin::discovery::DeviceIdStrategy::default(),
            &h.node.judge(),
        )
        .records,
    );
    let metrics = Metrics::new(
        state.reader(),
        StatusReader {
            registration: Writer::default().reader(),
            competition: Writer::default().reader(),
        },
        &AllocationMetrics::default(),
        Arc::new(ScanStats::new(Duration::from_secs(5))),
        &h.node.sysfs,
        Writer::default().reader(),
        true,
    );
    let render = summary(
        &timed(SCRAPES, || async {
            let body = metrics.scrape().await;
            http_body_util::BodyExt::collect(body)
                .await
                .expect("scrape");
        })
        .await,
    );
    // With the kubelet's PodResources answering, each scrape labels the counters with their holders.
    let holders: Vec<PodResources> = h
        .efas()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            pod(
                "ml",
                &format!("trainer-{i}"),
                "main",
                RESOURCE,
                &[d.ibdev.as_str()],
            )
        })
        .collect();
    // Its own thread, as the kubelet is its own process: answering List must not slow the
    // client that times Allocate.
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let (ready, started) = std::sync::mpsc::channel();
    let stub_stop = tokio_util::sync::CancellationToken::new();
    let stub = std::thread::spawn({
        let stop = stub_stop.clone();
        move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("PodResources runtime")
                .block_on(async {
                    let _stub = PodResourcesStub::start(&socket, holders).expect("PodResources");
                    let _ = ready.send(());
                    stop.cancelled().await;
                })
        }
    });
    started.recv().expect("PodResources started");
    // The plugin polls PodResources in the background; scrapes only read what it last saw.
    let labelled = Instant::now();
    while !http_get(address, "/metrics")
        .await
        .1
        .contains("pod=\"trainer-0\"")
    {
        assert!(
            labelled.elapsed() < Duration::from_secs(15),
            "no pod labels"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let attributed = summary(
        &timed(SCRAPES, || async {
            let text = http_get(address, "/metrics").await.1;
            assert!(text.contains("pod=\"trainer-0\""), "no pod labels");
        })
        .await,
    );
    let quiet = summary(&allocations(&h.kubelet, &id, ALLOCATIONS).await);
    // Far more often than any Prometheus scrapes, yet a realistic rhythm; then the worst case.
    let (frequent, frequent_scrapes) = while_scraping(address, Duration::from_millis(100), || {
        allocations(&h.kubelet, &id, 20 * ALLOCATIONS)
    })
    .await;
    let (busy, busy_scrapes) = while_scraping(address, Duration::ZERO, || {
        allocations(&h.kubelet, &id, ALLOCATIONS)
    })
    .await;
    stub_stop.cancel();
    stub.join().expect("PodResources thread");

    let pid = h.plugin_pid();
    let rss_before = status_kib(pid, "VmRSS");
    let fds_before = support::fds_and_tasks(pid).0;
    let snapshots = h.kubelet.view().borrow().snapshots;
    let (flooded, flood) = while_flooding(address, pid, || async {
        let mut samples = Vec::new();
        let until = Instant::now() + FLOOD_TIME;
        while Instant::now() < until {
            samples.extend(allocations(&h.kubelet, &id, ALLOCATIONS).await);
        }
        samples
    })
    .await;
    let view = h.kubelet.view().borrow().clone();
    let unchanged = view.snapshots == snapshots && view.healthy() == h.efas().len();

    println!(
        "p5.48xlarge: {} EFAs, {series} counter series, {} bytes per scrape",
        h.efas().len(),
        text.len()
    );
    println!("scrapes while timing Allocate: {frequent_scrapes} at 10/s, {busy_scrapes} non-stop");
    println!(
        "flood of {FLOOD} idle connections ({}x the cap), {} connects in {:.1} s: \
         at most {} held open, plugin fds {} before ({series} counter files), at most {} during; \
         VmRSS {} KiB before, peak (VmHWM) {} KiB; device state {}\n",
        FLOOD / MAX_CONNECTIONS,
        flood.connects,
        flood.took.as_secs_f64(),
        flood.most_open,
        fds_before,
        flood.most_fds,
        rss_before,
        status_kib(pid, "VmHWM"),
        if unchanged { "unchanged" } else { "CHANGED" }
    );
    h.terminate_plugin();
    vec![
        ("GET /metrics (32 EFAs)", scrape),
        ("  of which sysfs reads", read),
        ("  render incl. reads", render),
        ("GET /metrics with pod labels", attributed),
        ("Allocate, no scrapes", quiet),
        ("Allocate, scraped 10/s", frequent),
        ("Allocate, scraped non-stop", busy),
        ("Allocate, 640 idle conns", flooded),
    ]
}

/// Ten times the endpoint's connection cap.
const FLOOD: usize = 10 * MAX_CONNECTIONS;
/// How often the flood replaces the connections the plugin closed.
const REFILL: Duration = Duration::from_millis(500);
/// How long Allocate is timed under the flood.
const FLOOD_TIME: Duration = Duration::from_secs(5);

struct Flood {
    connects: usize,
    took: Duration,
    /// The most connections the plugin held open at one check.
    most_open: usize,
    most_fds: usize,
}

/// Runs `measure` while another thread keeps [`FLOOD`] idle connections to `address`: every
/// [`REFILL`] it opens a new one for each the plugin closed, as a persistent attacker would.
async fn while_flooding<F, Fut>(address: SocketAddr, pid: u32, measure: F) -> (Summary, Flood)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Vec<Duration>>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let flooder = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut flood = Flood {
                connects: 0,
                took: Duration::ZERO,
                most_open: 0,
                most_fds: 0,
            };
            let mut open: Vec<std::net::TcpStream> = Vec::with_capacity(FLOOD);
            while !stop.load(Ordering::Relaxed) {
                open.retain(|mut stream| {
                    use std::io::Read;
                    // Still open: nothing to read yet. Closed: end of stream (or reset).
                    matches!(stream.read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                flood.most_open = flood.most_open.max(open.len());
                flood.most_fds = flood.most_fds.max(support::fds_and_tasks(pid).0);
                while open.len() < FLOOD {
                    let Ok(stream) = std::net::TcpStream::connect(address) else {
                        break;
                    };
                    stream.set_nonblocking(true).expect("non-blocking");
                    open.push(stream);
                    flood.connects += 1;
                }
                std::thread::sleep(REFILL);
            }
            flood
        }
    });
    // Let the flood fill up before the first call is timed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let samples = measure().await;
    stop.store(true, Ordering::Relaxed);
    let mut flood = flooder.join().expect("flooder");
    flood.took = started.elapsed();
    (summary(&samples), flood)
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

/// Runs `measure` while another thread scrapes every `every` (back to back for zero); returns
/// its summary and the number of scrapes meanwhile.
async fn while_scraping<F, Fut>(
    address: SocketAddr,
    every: Duration,
    measure: F,
) -> (Summary, usize)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Vec<Duration>>,
{
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
                        http_get(address, "/metrics").await;
                        scraped.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(every).await;
                    }
                })
        }
    });
    let samples = measure().await;
    stop.store(true, Ordering::Relaxed);
    scraper.join().expect("scraper");
    (summary(&samples), scraped.load(Ordering::Relaxed))
}

async fn allocations(kubelet: &KubeletStub, id: &str, n: usize) -> Vec<Duration> {
    let client = kubelet.plugin().expect("plugin connection");
    timed(n, || {
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
