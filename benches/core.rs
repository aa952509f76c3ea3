//! Core performance figures, on the p5 shape unless stated: start-up to Register, Allocate
//! latency over the Unix socket, re-registration after a kubelet restart, resident memory, idle
//! CPU, and a scan of the 256-device node. Prints medians and percentiles from one run.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use efa_device_plugin::health;
use efa_device_plugin::kubelet_stub::KubeletStub;
use efa_device_plugin::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use efa_device_plugin::simulate::{FakeNode, Nodes, Shape};

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

#[tokio::main(flavor = "current_thread")]
async fn main() {
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

    let mut client = kubelet.plugin().unwrap();
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: devices.iter().take(8).map(|d| d.bdf.clone()).collect(),
        }],
    };
    let mut samples = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let started = Instant::now();
        client.allocate(request.clone()).await.expect("allocate");
        samples.push(started.elapsed());
    }
    let median = percentile(&mut samples, 0.5);
    let p99 = percentile(&mut samples, 0.99);
    row(
        "Allocate of 8 IDs over the socket, 2000 calls",
        format!(
            "p50 {:.0} µs, p99 {:.0} µs",
            median.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6
        ),
        "p99 ≤ 1 ms",
    );

    let mut samples = Vec::new();
    for _ in 0..20 {
        let calls = kubelet.view().borrow().register_calls;
        kubelet.restart().await.unwrap();
        let started = Instant::now();
        kubelet
            .wait_for(TIMEOUT, |v| v.register_calls > calls)
            .await
            .expect("re-registration");
        samples.push(started.elapsed());
        kubelet
            .wait_for(TIMEOUT, |v| v.stream_open)
            .await
            .expect("stream");
    }
    row(
        "kubelet.sock re-created to Register (median)",
        format!(
            "{:.1} ms",
            percentile(&mut samples, 0.5).as_secs_f64() * 1e3
        ),
        "≤ 100 ms",
    );

    row(
        "VmRSS, registered, one stream open",
        format!("{:.1} MiB", vm_rss_kib(child.id()) as f64 / 1024.0),
        "≤ 8 MiB",
    );

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
        let records = health::observe(&dense.sysfs, &dense.dev, true).records;
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
