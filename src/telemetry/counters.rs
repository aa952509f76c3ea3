//! EFA hardware counters, read from sysfs when Prometheus scrapes and never on the Allocate path.
//!
//! The set of counters depends on the kernel, so every file of a counter directory is exported
//! under its own name rather than a fixed list. Anything that cannot be read as a number is
//! skipped: a device going away between the listing and the read is normal, not an error.

use std::fs;
use std::path::Path;

/// The counter directories of one RDMA device, relative to `<sysfs>/class/infiniband/<ibdev>`.
/// EFA has one port, so port 1 is the only one.
const COUNTER_DIRS: [&str; 2] = ["hw_counters", "ports/1/hw_counters"];

/// The rdma core puts this tunable next to the counters: it is how long values are cached (ms),
/// not a count of anything.
const NOT_A_COUNTER: &str = "lifespan";

/// One device's counters, in name order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCounters {
    pub device: String,
    pub ibdev: String,
    pub values: Vec<(String, u64)>,
}

/// Reads the counters of each `(device id, ibdev)`.
pub fn read(sysfs_root: &Path, devices: &[(String, String)]) -> Vec<DeviceCounters> {
    let class = sysfs_root.join("class/infiniband");
    devices
        .iter()
        .map(|(device, ibdev)| {
            let base = class.join(ibdev);
            let mut values = Vec::new();
            for dir in COUNTER_DIRS {
                read_dir(&base.join(dir), &mut values);
            }
            values.sort();
            // A name present at device and port level would make two series with one label
            // set; the port's value is the one that describes traffic.
            values.dedup_by(|later, earlier| later.0 == earlier.0);
            DeviceCounters {
                device: device.clone(),
                ibdev: ibdev.clone(),
                values,
            }
        })
        .collect()
}

fn read_dir(dir: &Path, values: &mut Vec<(String, u64)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name == NOT_A_COUNTER || !is_metric_name(&name) {
            continue;
        }
        let Ok(text) = fs::read_to_string(entry.path()) else {
            continue;
        };
        if let Ok(value) = text.trim().parse::<u64>() {
            values.push((name, value));
        }
    }
}

/// Whether `efa_<name>_total` is a valid Prometheus metric name.
fn is_metric_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{DEVICE_COUNTERS, FakeNode, Nodes, PORT_COUNTERS, Shape};

    #[test]
    fn reads_port_and_device_counters_and_skips_what_is_not_a_count() {
        let root = tempfile::tempdir().unwrap();
        let (node, devices) = FakeNode::build(root.path(), Shape::P4d, Nodes::Files).unwrap();
        let efa = &devices[0];
        node.set_port_counter(efa, "tx_bytes", 12345).unwrap();
        let ports = node
            .sysfs
            .join("class/infiniband")
            .join(&efa.ibdev)
            .join("ports/1/hw_counters");
        fs::write(ports.join("rx_bytes"), "not a number\n").unwrap();
        fs::write(ports.join(NOT_A_COUNTER), "10\n").unwrap();
        fs::write(ports.join("bad-name"), "1\n").unwrap();

        let read = read(
            &node.sysfs,
            &[
                (efa.bdf.clone(), efa.ibdev.clone()),
                ("0000:ff:00.0".into(), "gone".into()),
            ],
        );
        assert_eq!(read.len(), 2);
        let names: Vec<&str> = read[0].values.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names.len(), PORT_COUNTERS.len() + DEVICE_COUNTERS.len() - 1);
        assert!(!names.contains(&"rx_bytes"));
        assert!(!names.contains(&NOT_A_COUNTER));
        assert!(names.contains(&"submitted_cmds"));
        assert!(read[0].values.contains(&("tx_bytes".into(), 12345)));
        assert!(
            read[1].values.is_empty(),
            "a missing device has no counters"
        );
    }
}
