//! GetPreferredAllocation latency: the policy function alone, in process, on simulated p5
//! (32 EFAs) and 256-EFA nodes. The kubelet waits on this call before every allocation, so
//! the figure that matters is the tail, not the mean.
//!
//! Run with `cargo bench --bench gpa`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use efa_device_plugin::allocation::preferred;
use efa_device_plugin::allocation::sharing::Sharing;
use efa_device_plugin::proto::deviceplugin::ContainerPreferredAllocationRequest;
use efa_device_plugin::testkit::simulate::{Shape, inventory};

struct Case {
    shape: Shape,
    replicas: u32,
    /// Every `taken`-th advertised ID is already allocated and so not offered.
    taken: Option<usize>,
    sizes: &'static [i32],
}

const CASES: &[Case] = &[
    Case {
        shape: Shape::P5,
        replicas: 1,
        taken: None,
        sizes: &[1, 4, 8, 16, 32],
    },
    Case {
        shape: Shape::P5,
        replicas: 1,
        taken: Some(3),
        sizes: &[4, 8],
    },
    Case {
        shape: Shape::P5,
        replicas: 4,
        taken: None,
        sizes: &[4, 32],
    },
    Case {
        shape: Shape::Dense256,
        replicas: 1,
        taken: None,
        sizes: &[1, 8, 64, 128, 256],
    },
    Case {
        shape: Shape::Dense256,
        replicas: 1,
        taken: Some(3),
        sizes: &[16, 64],
    },
];

/// Latency figures of one row, in microseconds.
struct Figures {
    median: f64,
    p99: f64,
    /// The 99th percentile over calls the thread ran through without being preempted: on a
    /// busy host, a single preemption costs a whole scheduler tick and swamps the figure.
    p99_running: f64,
    preempted: usize,
}

/// Times `calls` calls after a warm-up.
fn measure(calls: usize, mut call: impl FnMut()) -> Figures {
    for _ in 0..calls / 10 {
        call();
    }
    let mut all = Vec::with_capacity(calls);
    let mut running = Vec::with_capacity(calls);
    for _ in 0..calls {
        let switches = preemptions();
        let start = Instant::now();
        call();
        let took = start.elapsed();
        all.push(took);
        if preemptions() == switches {
            running.push(took);
        }
    }
    let p99 = |times: &mut Vec<Duration>| {
        times.sort_unstable();
        times
            .get(times.len() * 99 / 100)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e6)
    };
    let preempted = calls - running.len();
    Figures {
        median: {
            all.sort_unstable();
            all[calls / 2].as_secs_f64() * 1e6
        },
        p99: p99(&mut all),
        p99_running: p99(&mut running),
        preempted,
    }
}

/// Times the kernel took the CPU away from this thread so far.
fn preemptions() -> u64 {
    std::fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("nonvoluntary_ctxt_switches:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    println!(
        "| shape | EFAs | replicas | IDs offered | size | median | p99 | p99 not preempted | calls preempted |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for case in CASES {
        let inventory = inventory(case.shape);
        let sharing = Sharing::replicas(NonZeroU32::new(case.replicas).unwrap());
        let offered: Vec<String> = inventory
            .devices()
            .flat_map(|r| sharing.advertised(&r.efa.id))
            .enumerate()
            .filter(|(i, _)| case.taken.is_none_or(|n| i % n != 0))
            .map(|(_, id)| id)
            .collect();
        for &size in case.sizes {
            let request = ContainerPreferredAllocationRequest {
                available_device_i_ds: offered.clone(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: size,
            };
            let calls = if inventory.devices().len() > 32 {
                2000
            } else {
                5000
            };
            let figures = measure(calls, || {
                black_box(preferred::choose(
                    black_box(&inventory),
                    sharing,
                    preferred::Avoid::NOTHING,
                    black_box(&request),
                ));
            });
            println!(
                "| {:?} | {} | {} | {} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {} of {calls} |",
                case.shape,
                inventory.devices().len(),
                case.replicas,
                offered.len(),
                size,
                figures.median,
                figures.p99,
                figures.p99_running,
                figures.preempted,
            );
        }
    }
}
