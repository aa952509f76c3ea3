//! Core performance figures, on the p5 shape unless stated: start-up to Register, Allocate
//! latency over the Unix socket against the floor of an empty RPC, re-registration after a
//! kubelet restart, resident memory and fds across 1,000 restarts, idle CPU, and a scan of the
//! 256-device node. Prints medians and percentiles from one run.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use efa_device_plugin::health;
use efa_device_plugin::proto::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest,
    registration_client::RegistrationClient,
    registration_server::{Registration, RegistrationServer},
};
use efa_device_plugin::testkit::kubelet_stub::KubeletStub;
use efa_device_plugin::testkit::simulate::{FakeDevice, FakeNode, Nodes, Shape};
use efa_device_plugin::uds;
use tokio_util::sync::CancellationToken;

const BINARY: &str = env!("CARGO_BIN_EXE_efa-device-plugin");
const TIMEOUT: Duration = Duration::from_secs(10);

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() - 1) as f64 * p).round() as usize;
    samples[index]
}

fn row(what: &str, figure: String, target: &str) {
    println!("| {what:<46} | {figure:>22} | {target:<10} |");
}

/// Scratch space in memory when the machine has it: sysfs itself lives in memory.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let builder = &mut tempfile::Builder::new();
    builder.prefix("efa-dp-bench.");
    if shm.is_dir() {
        builder.tempdir_in(shm)
    } else {
        builder.tempdir()
    }
    .expect("scratch dir")
}

fn spawn(node: &FakeNode, plugin_dir: &Path, interval: &str) -> Child {
    Command::new(BINARY)
        .arg("--sysfs-root")
        .arg(&node.sysfs)
        .arg("--dev-root")
        .arg(&node.dev)
        .arg("--device-plugin-dir")
        .arg(plugin_dir)
        .args(["--rescan-interval", interval, "--log-level", "warn"])
        // The simulated nodes are regular files.
        .arg("--test-only-regular-file-nodes")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn plugin")
}

fn stop(mut child: Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let _ = child.wait();
}

/// Clock ticks of user + system CPU a process has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after_name = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn vm_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count()
}

/// Restarts the stand-in kubelet; how long from its new socket to the plugin's Register. Returns
/// once the new stream is open, so restarts do not overlap.
async fn restart(kubelet: &mut KubeletStub) -> Duration {
    let calls = kubelet.view().borrow().register_calls;
    kubelet.restart().await.unwrap();
    let started = Instant::now();
    kubelet
        .wait_for(TIMEOUT, |v| v.register_calls > calls)
        .await
        .expect("re-registration");
    let took = started.elapsed();
    kubelet
        .wait_for(TIMEOUT, |v| v.stream_open)
        .await
        .expect("stream");
    took
}

/// Set in the child that serves the floor: an empty unary RPC on a bare tonic server.
const FLOOR_SOCKET_ENV: &str = "EFA_DP_BENCH_FLOOR_SOCKET";

struct EmptyRegistration;

#[tonic::async_trait]
impl Registration for EmptyRegistration {
    async fn register(
        &self,
        _: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        Ok(tonic::Response::new(Empty {}))
    }
}

/// The floor runs in its own process on its own current-thread runtime, as the plugin does, so
/// both sides of the comparison cross the same process boundary.
fn serve_floor(socket: &Path) -> ! {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let listener = uds::bind(socket).expect("floor socket");
        let _ = uds::spawn_server(
            listener,
            RegistrationServer::new(EmptyRegistration),
            CancellationToken::new(),
        )
        .await;
    });
    std::process::exit(0)
}

/// Allocate of 1 and 8 IDs and the empty RPC, interleaved call by call so that they share
/// whatever else the machine is doing.
async fn allocate_against_the_floor(kubelet: &KubeletStub, devices: &[FakeDevice], root: &Path) {
    let socket = root.join("floor.sock");
    let mut floor_server = Command::new(std::env::current_exe().expect("own path"))
        .env(FLOOR_SOCKET_ENV, &socket)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn floor server");
    let mut floor = loop {
        if let Ok(channel) = uds::dial(&socket).await {
            break RegistrationClient::new(channel);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut client = kubelet.plugin().unwrap();
    let request = |n: usize| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: devices.iter().take(n).map(|d| d.ibdev.clone()).collect(),
        }],
    };
    let (one, eight) = (request(1), request(8));
    let mut samples = [(); 3].map(|()| Vec::with_capacity(3000));
    for round in 0..3100 {
        let started = Instant::now();
        floor
            .register(RegisterRequest::default())
            .await
            .expect("empty RPC");
        let floor_took = started.elapsed();
        let started = Instant::now();
        client.allocate(one.clone()).await.expect("allocate 1");
        let one_took = started.elapsed();
        let started = Instant::now();
        client.allocate(eight.clone()).await.expect("allocate 8");
        let eight_took = started.elapsed();
        // The first rounds warm connections and allocators up.
        if round >= 100 {
            samples[0].push(floor_took);
            samples[1].push(one_took);
            samples[2].push(eight_took);
        }
    }
    let _ = floor_server.kill();
    let _ = floor_server.wait();
    let [mut floor, mut one, mut eight] = samples;
    let floor_p50 = percentile(&mut floor, 0.5);
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    row(
        "floor: empty unary RPC, bare tonic, 3000 calls",
        format!(
            "p50 {:.0} µs, p99 {:.0} µs",
            micros(floor_p50),
            micros(percentile(&mut floor, 0.99))
        ),
        "",
    );
    for (what, samples) in [
        ("Allocate of 1 ID, 3000 calls", &mut one),
        ("Allocate of 8 IDs, 3000 calls", &mut eight),
    ] {
        let p50 = percentile(samples, 0.5);
        row(
            what,
            format!(
                "p50 {:.0} µs ({:.2}× floor), p99 {:.0} µs",
                micros(p50),
                p50.as_secs_f64() / floor_p50.as_secs_f64(),
                micros(percentile(samples, 0.99))
            ),
            "p50 ≤ 1.5× floor",
        );
    }
}

async fn start_to_register(node: &FakeNode, root: &Path) -> Duration {
    let mut samples = Vec::new();
    for round in 0..30 {
        let plugin_dir = root.join(format!("start-{round}"));
        let kubelet = KubeletStub::start(&plugin_dir).unwrap();
        let started = Instant::now();
        let child = spawn(node, &plugin_dir, "5s");
        kubelet
            .wait_for(TIMEOUT, |v| v.register_calls > 0)
            .await
            .expect("registration");
        samples.push(started.elapsed());
        stop(child);
        kubelet.stop().await;
    }
    percentile(&mut samples, 0.5)
}

fn main() {
    if let Some(socket) = std::env::var_os(FLOOR_SOCKET_ENV) {
        serve_floor(Path::new(&socket));
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(measure());
}

async fn measure() {
    let root = scratch();
    let (node, devices) =
        FakeNode::build(&root.path().join("p5"), Shape::P5, Nodes::Files).unwrap();
    println!(
        "| measure (p5: 32 EFAs unless stated)            |                 figure | target     |"
    );
    println!(
        "|------------------------------------------------|------------------------|------------|"
    );

    let start = start_to_register(&node, root.path()).await;
    row(
        "process start to Register received (median)",
        format!("{:.1} ms", start.as_secs_f64() * 1e3),
        "≤ 20 ms",
    );

    let plugin_dir = root.path().join("device-plugins");
    let mut kubelet = KubeletStub::start(&plugin_dir).unwrap();
    let child = spawn(&node, &plugin_dir, "5s");
    kubelet
        .wait_for(TIMEOUT, |v| {
            v.stream_open && v.devices.len() == devices.len()
        })
        .await
        .expect("registration");

    let rss_before = vm_rss_kib(child.id());
    let fds_before = fd_count(child.id());
    row(
        "VmRSS, registered, one stream open",
        format!("{:.1} MiB", rss_before as f64 / 1024.0),
        "≤ 8 MiB",
    );

    allocate_against_the_floor(&kubelet, &devices, root.path()).await;

    let mut samples = Vec::new();
    for _ in 0..100 {
        samples.push(restart(&mut kubelet).await);
    }
    row(
        "kubelet.sock re-created to Register, 100 times",
        format!(
            "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            percentile(&mut samples, 0.5).as_secs_f64() * 1e3,
            percentile(&mut samples, 0.99).as_secs_f64() * 1e3,
            samples.iter().max().unwrap().as_secs_f64() * 1e3,
        ),
        "p99 ≤ 50 ms",
    );

    // Two points tell a plateau (allocator high-water) from a leak, which keeps growing.
    let growth = |restarts: usize| {
        row(
            &format!("VmRSS and fds after {restarts} kubelet restarts"),
            format!(
                "{:.1} MiB ({:+} KiB), {} fds ({:+})",
                vm_rss_kib(child.id()) as f64 / 1024.0,
                vm_rss_kib(child.id()) as i64 - rss_before as i64,
                fd_count(child.id()),
                fd_count(child.id()) as i64 - fds_before as i64,
            ),
            "no growth",
        )
    };
    growth(samples.len());
    for _ in samples.len()..1000 {
        restart(&mut kubelet).await;
    }
    growth(1000);

    let window = Duration::from_secs(30);
    let ticks_before = cpu_ticks(child.id());
    tokio::time::sleep(window).await;
    let ticks = cpu_ticks(child.id()) - ticks_before;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    row(
        "idle CPU at the default 5s interval, 30 s",
        format!(
            "{:.3} % of a core",
            ticks as f64 / hz / window.as_secs_f64() * 100.0
        ),
        "≤ 0.1 %",
    );
    stop(child);
    kubelet.stop().await;

    let (dense, _) =
        FakeNode::build(&root.path().join("dense"), Shape::Dense256, Nodes::Files).unwrap();
    let mut samples = Vec::new();
    for _ in 0..50 {
        let started = Instant::now();
        let records = health::observe(
            &dense.sysfs,
            efa_device_plugin::discovery::DeviceIdStrategy::default(),
            &dense.judge(),
        )
        .records;
        samples.push(started.elapsed());
        assert_eq!(records.len(), 256);
    }
    row(
        "scan + health of the 256-device node (median)",
        format!(
            "{:.1} ms",
            percentile(&mut samples, 0.5).as_secs_f64() * 1e3
        ),
        "≤ 20 ms",
    );
}
