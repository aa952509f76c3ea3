//! EFA hardware counters, read from sysfs when Prometheus scrapes and never on the Allocate path.
//!
//! The set of counters depends on the kernel, so every file of a counter directory is exported
//! under its own name rather than a fixed list. Anything that cannot be read as a number is
//! skipped: a device going away between the listing and the read is normal, not an error.
//!
//! The files stay open between scrapes. sysfs calls the attribute's `show()` again for a
//! `pread` at offset 0 (Documentation/filesystems/sysfs.rst), so an open file gives a fresh
//! value, and one `pread` per counter costs a third of opening, reading and closing it: on a p5
//! that is the difference between a scrape within its 2 ms budget or not. An open sysfs file
//! does not hold its device: once the device is gone the read fails and the files are dropped.
//! The price is kernel memory: each open sysfs file keeps a page for its value once read, about
//! 2.6 MiB for a p5's 672 counters, charged to the pod.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::dir::Dir;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::Mode;

/// The counter directories of one RDMA device, relative to `<sysfs>/class/infiniband/<ibdev>`.
/// EFA has one port, so port 1 is the only one. A name present at both levels would make two
/// series with one label set; the port's comes first and wins, as it describes the traffic.
const COUNTER_DIRS: [&str; 2] = ["ports/1/hw_counters", "hw_counters"];

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

/// The counter files of the devices, kept open across scrapes.
pub struct CounterFiles {
    class: PathBuf,
    /// At most this many files stay open; past it, a device's files are opened per scrape.
    budget: usize,
    open: Mutex<HashMap<String, OpenDevice>>,
}

/// The open counter files of one ibdev, in name order.
struct OpenDevice {
    /// The ibdev dir the files belong to: a device removed and added again under the same name
    /// has a new one, and the old files would only repeat stale values.
    dir: Option<(u64, u64)>,
    files: Vec<(String, File)>,
}

impl CounterFiles {
    pub fn new(sysfs_root: &Path) -> Self {
        Self::with_budget(sysfs_root, super::fds::counter_budget())
    }

    pub fn with_budget(sysfs_root: &Path, budget: usize) -> Self {
        CounterFiles {
            class: sysfs_root.join("class/infiniband"),
            budget,
            open: Mutex::default(),
        }
    }

    /// Reads the counters of each `(device id, ibdev)`.
    pub fn read(&self, devices: &[(String, String)]) -> Vec<DeviceCounters> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|ibdev, _| devices.iter().any(|(_, wanted)| wanted == ibdev));
        let mut kept: usize = open.values().map(|d| d.files.len()).sum();
        let mut all = Vec::with_capacity(devices.len());
        for (device, ibdev) in devices {
            let base = self.class.join(ibdev);
            let dir = identity(&base);
            let cached = match open.get(ibdev) {
                Some(entry) if entry.dir == dir => entry.read(),
                _ => None,
            };
            let values = match cached {
                Some(values) => values,
                None => {
                    if let Some(stale) = open.remove(ibdev) {
                        kept -= stale.files.len();
                    }
                    let entry = OpenDevice::open(&base, dir);
                    let values = entry.read().unwrap_or_default();
                    if kept + entry.files.len() <= self.budget {
                        kept += entry.files.len();
                        open.insert(ibdev.clone(), entry);
                    }
                    values
                }
            };
            all.push(DeviceCounters {
                device: device.clone(),
                ibdev: ibdev.clone(),
                values,
            });
        }
        all
    }
}

impl OpenDevice {
    fn open(base: &Path, dir: Option<(u64, u64)>) -> Self {
        let mut files: Vec<(String, File)> = Vec::new();
        for counters in COUNTER_DIRS {
            for (name, file) in open_dir(&base.join(counters)) {
                if !files.iter().any(|(known, _)| *known == name) {
                    files.push((name, file));
                }
            }
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        OpenDevice { dir, files }
    }

    /// Every value, or `None` when a file no longer reads (its device went away).
    fn read(&self) -> Option<Vec<(String, u64)>> {
        let mut values = Vec::with_capacity(self.files.len());
        for (name, file) in &self.files {
            // A u64 has at most 20 digits; anything longer is not a counter.
            let mut buf = [0u8; 32];
            let n = file.read_at(&mut buf, 0).ok()?;
            let parsed = std::str::from_utf8(&buf[..n]).ok().map(str::trim);
            if let Some(value) = parsed.and_then(|text| text.parse().ok()) {
                values.push((name.clone(), value));
            }
        }
        Some(values)
    }
}

/// Opens every counter file of `dir` relative to it, so no open walks the full sysfs path.
fn open_dir(dir: &Path) -> Vec<(String, File)> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let Ok(mut handle) = Dir::open(dir, flags, Mode::empty()) else {
        return Vec::new();
    };
    let names: Vec<String> = handle
        .iter()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().ok().map(str::to_owned))
        .filter(|name| name != NOT_A_COUNTER && is_metric_name(name))
        .collect();
    names
        .into_iter()
        .filter_map(|name| {
            // Non-blocking, so a FIFO cannot hold the open; only regular files are kept.
            let fd = openat(
                &handle,
                name.as_str(),
                OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
                Mode::empty(),
            )
            .ok()?;
            let file = File::from(fd);
            crate::fsread::check_regular(&file).ok()?;
            Some((name, file))
        })
        .collect()
}

fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether `efa_<name>_total` is a valid Prometheus metric name.
fn is_metric_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::testkit::simulate::{DEVICE_COUNTERS, FakeNode, Nodes, PORT_COUNTERS, Shape};

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

        let read = CounterFiles::new(&node.sysfs).read(&[
            (efa.bdf.clone(), efa.ibdev.clone()),
            ("0000:ff:00.0".into(), "gone".into()),
        ]);
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

    #[test]
    fn open_files_give_fresh_values_and_follow_a_device_added_again() {
        let root = tempfile::tempdir().unwrap();
        let (node, devices) = FakeNode::build(root.path(), Shape::P4d, Nodes::Files).unwrap();
        let pairs: Vec<(String, String)> = devices
            .iter()
            .map(|d| (d.bdf.clone(), d.ibdev.clone()))
            .collect();
        let tx = |read: &[DeviceCounters], i: usize| {
            read[i]
                .values
                .iter()
                .find(|(name, _)| name == "tx_bytes")
                .map(|(_, v)| *v)
        };
        // Room for two devices' files only: the others are opened per scrape.
        let per_device = PORT_COUNTERS.len() + DEVICE_COUNTERS.len();
        let files = CounterFiles::with_budget(&node.sysfs, 2 * per_device);
        assert_eq!(tx(&files.read(&pairs), 0), Some(0));
        for (i, device) in devices.iter().enumerate() {
            node.set_port_counter(device, "tx_bytes", 100 + i as u64)
                .unwrap();
        }
        let read = files.read(&pairs);
        assert_eq!(
            (0..4).map(|i| tx(&read, i)).collect::<Vec<_>>(),
            [Some(100), Some(101), Some(102), Some(103)]
        );

        node.remove(&devices[0]).unwrap();
        node.add(&devices[0]).unwrap();
        assert_eq!(
            tx(&files.read(&pairs), 0),
            Some(0),
            "not the old files' values"
        );
        node.remove(&devices[1]).unwrap();
        assert!(files.read(&pairs)[1].values.is_empty());
    }
}
