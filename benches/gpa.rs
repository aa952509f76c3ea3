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
use efa_device_plugin::simulate::{Shape, inventory};

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

/// Median and 99th percentile of `calls` timed calls, after a warm-up.
fn measure(calls: usize, mut call: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..calls / 10 {
        call();
    }
    let mut times: Vec<Duration> = (0..calls)
        .map(|_| {
            let start = Instant::now();
            call();
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    (times[calls / 2], times[calls * 99 / 100])
}

fn main() {
    println!(
        "{:<9} {:>4} {:>8} {:>8} {:>5} {:>11} {:>11}",
        "shape", "EFAs", "replicas", "offered", "size", "median", "p99"
    );
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
                500
            } else {
                5000
            };
            let (median, p99) = measure(calls, || {
                black_box(preferred::choose(
                    black_box(&inventory),
                    sharing,
                    black_box(&request),
                ));
            });
            println!(
                "{:<9} {:>4} {:>8} {:>8} {:>5} {:>9.1}µs {:>9.1}µs",
                format!("{:?}", case.shape),
                inventory.devices().len(),
                case.replicas,
                offered.len(),
                size,
                median.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
            );
        }
    }
}
