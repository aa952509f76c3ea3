//! Simulated nodes: sysfs and dev trees laid out the way the kernel lays them out, symlinks
//! included, for the demo and the tests.
//!
//! Each shape follows a real instance family: p4d (4 EFAs on 4 PCIe roots, 2 NUMA nodes), p5
//! (32 EFAs, 4 per GPU root, uverbs numbers not in name order), p5en (16, 2 per switch), p6-b200
//! (8 EFAs plus 2 mlx5 `ibp*` decoys), trn2 (16), Bottlerocket's `efa_N` names, g5 (NUMA -1),
//! nodes with no EFA, and a 256-device node whose later uverbs nodes have a dynamic major.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::discovery::{DevNum, DeviceIdStrategy, Efa};
use crate::state::{DeviceRecord, Inventory, Verdict};

/// The kernel's static uverbs major; the first 32 nodes use minors from 192.
const UVERBS_MAJOR: u32 = 231;
const UVERBS_FIRST_MINOR: u32 = 192;
const UVERBS_STATIC_COUNT: u32 = 32;
/// A dynamic major, as the kernel hands out for uverbs nodes past the first 32.
const DYNAMIC_MAJOR: u32 = 511;

pub(crate) const EFA_VENDOR: &str = "0x1d0f";
const MLX5_VENDOR: &str = "0x15b3";

/// Port counters the kernel's efa driver exposes under `ports/1/hw_counters`.
pub(crate) const PORT_COUNTERS: &[&str] = &[
    "tx_bytes",
    "tx_pkts",
    "rx_bytes",
    "rx_pkts",
    "rx_drops",
    "send_bytes",
    "send_wrs",
    "recv_bytes",
    "recv_wrs",
    "rdma_read_bytes",
    "rdma_write_bytes",
    "retrans_bytes",
    "retrans_pkts",
    "retrans_timeout_events",
];
/// Device-level counters under `hw_counters`.
pub(crate) const DEVICE_COUNTERS: &[&str] = &[
    "submitted_cmds",
    "completed_cmds",
    "cmds_err",
    "no_completion_cmds",
    "keep_alive_rcvd",
];

/// One RDMA device of a simulated node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeDevice {
    /// PCI address, e.g. `0000:10:1b.0`.
    pub bdf: String,
    /// Bridges from the root complex down to the function, e.g. `["pci0000:10", "0000:10:01.0"]`.
    pub parents: Vec<String>,
    pub ibdev: String,
    pub uverbs: u32,
    pub dev: DevNum,
    /// -1 for no NUMA affinity, as the kernel writes it.
    pub numa: i32,
    pub driver: String,
    pub vendor: String,
    pub device: String,
}

impl FakeDevice {
    pub fn uverbs_name(&self) -> String {
        format!("uverbs{}", self.uverbs)
    }

    pub fn is_efa(&self) -> bool {
        self.driver == "efa"
    }

    /// The device as a scan of its simulated tree reads it, for tests and benchmarks that need
    /// no files.
    pub fn efa(&self) -> Efa {
        self.efa_named(DeviceIdStrategy::default())
    }

    /// [`FakeDevice::efa`], with its ID under `ids`.
    pub fn efa_named(&self, ids: DeviceIdStrategy) -> Efa {
        let mut pci_path = self.parents.join("/");
        pci_path.push('/');
        pci_path.push_str(&self.bdf);
        Efa {
            id: match ids {
                DeviceIdStrategy::Ibdev => self.ibdev.clone(),
                DeviceIdStrategy::Pci => self.bdf.clone(),
            },
            pci_address: self.bdf.clone(),
            ibdev: self.ibdev.clone(),
            uverbs: self.uverbs_name(),
            dev: self.dev,
            numa_node: u32::try_from(self.numa).ok(),
            pci_path,
            vendor: self.vendor.clone(),
            device: self.device.clone(),
        }
    }
}

/// Instance shapes the tests and the demo simulate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    P4d,
    P5,
    P5en,
    P6B200,
    Trn2,
    /// A p4d as Bottlerocket names it: `efa_0` … `efa_3`.
    Bottlerocket,
    G5,
    /// An EFA-capable instance with the class dir present but no EFA attached.
    NoEfa,
    /// The driver is not loaded: not even `/sys/class/infiniband`.
    NoClassDir,
    /// 256 EFAs over 16 roots; nodes past the 32nd have a dynamic major.
    Dense256,
    /// This many EFAs, 16 per root, laid out as `Dense256`: far denser than any instance, to
    /// find where the device list outgrows the kubelet's message limit or the pod's memory.
    Dense(u32),
}

fn uverbs_dev(index: u32) -> DevNum {
    if index < UVERBS_STATIC_COUNT {
        DevNum {
            major: UVERBS_MAJOR,
            minor: UVERBS_FIRST_MINOR + index,
        }
    } else {
        DevNum {
            major: DYNAMIC_MAJOR,
            minor: index - UVERBS_STATIC_COUNT,
        }
    }
}

/// AL2023's rdma-core names a device after its PCI location: `rdmap<bus>s<slot>`, with
/// `P<domain>` in front outside domain 0.
fn pci_name(domain: u32, bus: u32, slot: u32) -> String {
    if domain == 0 {
        format!("rdmap{bus}s{slot}")
    } else {
        format!("rdmaP{domain}p{bus}s{slot}")
    }
}

fn efa(
    domain: u32,
    bus: u32,
    slot: u32,
    parents: Vec<String>,
    uverbs: u32,
    numa: i32,
) -> FakeDevice {
    FakeDevice {
        bdf: format!("{domain:04x}:{bus:02x}:{slot:02x}.0"),
        parents,
        ibdev: pci_name(domain, bus, slot),
        uverbs,
        dev: uverbs_dev(uverbs),
        numa,
        driver: "efa".into(),
        vendor: EFA_VENDOR.into(),
        device: "0xefa1".into(),
    }
}

/// A root complex with `per_root` EFAs, each behind its own downstream port of one switch.
fn switched_root(
    domain: u32,
    root_bus: u32,
    per_root: u32,
    numa: i32,
    first_uverbs: u32,
) -> Vec<FakeDevice> {
    let root = format!("pci{domain:04x}:{root_bus:02x}");
    let root_port = format!("{domain:04x}:{root_bus:02x}:01.0");
    let upstream = format!("{domain:04x}:{:02x}:00.0", root_bus + 1);
    (0..per_root)
        .map(|k| {
            let downstream = format!("{domain:04x}:{:02x}:{:02x}.0", root_bus + 2, k);
            let bus = root_bus + 3 + k;
            let parents = vec![
                root.clone(),
                root_port.clone(),
                upstream.clone(),
                downstream,
            ];
            let mut device = efa(domain, bus, 0, parents, first_uverbs + k, numa);
            device.device = "0xefa2".into();
            device
        })
        .collect()
}

/// The devices of a shape, EFAs and decoys alike.
pub fn devices(shape: Shape) -> Vec<FakeDevice> {
    match shape {
        Shape::P4d | Shape::Bottlerocket => {
            let mut all: Vec<FakeDevice> = [(0x10, 0), (0x20, 0), (0x90, 1), (0xa0, 1)]
                .into_iter()
                .enumerate()
                .map(|(i, (bus, numa))| {
                    efa(
                        0,
                        bus,
                        0x1b,
                        vec![format!("pci0000:{bus:02x}")],
                        i as u32,
                        numa,
                    )
                })
                .collect();
            if shape == Shape::Bottlerocket {
                for (i, device) in all.iter_mut().enumerate() {
                    device.ibdev = format!("efa_{i}");
                }
            }
            all
        }
        Shape::P5 => {
            // uverbs numbers follow probe order, which is not name order.
            let order = |i: u32| (i * 7 + 3) % 32;
            let mut all = Vec::new();
            for (r, root_bus) in [0x20, 0x31, 0x42, 0x53, 0x96, 0xa7, 0xb8, 0xc9]
                .into_iter()
                .enumerate()
            {
                let numa = if r < 4 { 0 } else { 1 };
                all.extend(switched_root(0, root_bus, 4, numa, 0));
            }
            for (i, device) in all.iter_mut().enumerate() {
                device.uverbs = order(i as u32);
                device.dev = uverbs_dev(device.uverbs);
            }
            all
        }
        Shape::P5en => (0..8u32)
            .flat_map(|r| switched_root(0, 0x10 + r * 0x10, 2, (r / 4) as i32, r * 2))
            .collect(),
        Shape::P6B200 => {
            let mut all = vec![mlx5(0x05, 0), mlx5(0x06, 1)];
            all.extend(
                (0..8u32).flat_map(|r| switched_root(0, 0x20 + r * 0x10, 1, (r / 4) as i32, 2 + r)),
            );
            all
        }
        Shape::Trn2 => (0..4u32)
            .flat_map(|r| switched_root(0, 0x20 + r * 0x20, 4, (r / 2) as i32, r * 4))
            .collect(),
        Shape::G5 => vec![efa(0, 0x00, 0x1c, vec!["pci0000:00".into()], 0, -1)],
        Shape::NoEfa | Shape::NoClassDir => Vec::new(),
        Shape::Dense256 => dense(256),
        Shape::Dense(count) => dense(count),
    }
}

/// `count` EFAs on roots of 16, one PCI domain per root.
fn dense(count: u32) -> Vec<FakeDevice> {
    (0..count.div_ceil(16))
        .flat_map(|r| {
            let on_root = (count - r * 16).min(16);
            switched_root(r, 0x10, on_root, (r / 8) as i32, r * 16)
        })
        .collect()
}

/// The snapshot the health monitor would publish for `shape` with every EFA healthy, for tests
/// and benchmarks of the allocation policy that need no files.
pub fn inventory(shape: Shape) -> Inventory {
    inventory_named(shape, DeviceIdStrategy::default())
}

/// [`inventory`], with IDs under `ids`.
pub fn inventory_named(shape: Shape, ids: DeviceIdStrategy) -> Inventory {
    let records = devices(shape)
        .iter()
        .filter(|d| d.is_efa())
        .map(|d| DeviceRecord {
            efa: d.efa_named(ids),
            verdict: Verdict::healthy(),
        })
        .collect();
    Inventory::default().observe(records).0
}

/// An mlx5 RDMA device as p6-b200 shows it: in `/sys/class/infiniband`, but no EFA.
fn mlx5(bus: u32, uverbs: u32) -> FakeDevice {
    FakeDevice {
        bdf: format!("0000:{bus:02x}:00.0"),
        parents: vec![format!("pci0000:{bus:02x}")],
        ibdev: format!("ibp{bus}s0"),
        uverbs,
        dev: uverbs_dev(uverbs),
        numa: 0,
        driver: "mlx5_core".into(),
        vendor: MLX5_VENDOR.into(),
        device: "0x1021".into(),
    }
}

/// What stands in the simulated `/dev/infiniband`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nodes {
    /// Real character devices (needs CAP_MKNOD).
    CharDevices,
    /// Empty regular files, for unprivileged runs: the plugin checks major:minor only on
    /// character devices.
    Files,
}

/// A simulated node on disk: `<root>/sys` and `<root>/dev`.
#[derive(Clone, Debug)]
pub struct FakeNode {
    pub sysfs: PathBuf,
    pub dev: PathBuf,
    pub nodes: Nodes,
}

impl FakeNode {
    /// Lays out `shape` under `root`.
    pub fn build(
        root: &Path,
        shape: Shape,
        nodes: Nodes,
    ) -> io::Result<(FakeNode, Vec<FakeDevice>)> {
        let node = FakeNode {
            sysfs: root.join("sys"),
            dev: root.join("dev"),
            nodes,
        };
        fs::create_dir_all(node.sysfs.join("devices"))?;
        fs::create_dir_all(&node.dev)?;
        if shape != Shape::NoClassDir {
            fs::create_dir_all(node.sysfs.join("class/infiniband"))?;
            fs::create_dir_all(node.sysfs.join("class/infiniband_verbs"))?;
        }
        let all = devices(shape);
        for device in &all {
            node.add(device)?;
        }
        Ok((node, all))
    }

    fn function_dir(&self, device: &FakeDevice) -> PathBuf {
        let mut dir = self.sysfs.join("devices");
        for parent in &device.parents {
            dir.push(parent);
        }
        dir.join(&device.bdf)
    }

    /// Adds a device: its PCI function, ibdev and uverbs dirs, class links, and its node.
    pub fn add(&self, device: &FakeDevice) -> io::Result<()> {
        let function = self.function_dir(device);
        fs::create_dir_all(&function)?;
        write(&function.join("vendor"), &device.vendor)?;
        write(&function.join("device"), &device.device)?;
        write(&function.join("numa_node"), &device.numa.to_string())?;
        write(
            &function.join("local_cpulist"),
            if device.numa == 1 { "48-95" } else { "0-47" },
        )?;
        self.bind(device)?;

        let ibdev_dir = function.join("infiniband").join(&device.ibdev);
        fs::create_dir_all(ibdev_dir.join("ports/1/hw_counters"))?;
        fs::create_dir_all(ibdev_dir.join("hw_counters"))?;
        write(&ibdev_dir.join("node_type"), "7: unspecified")?;
        write(&ibdev_dir.join("node_guid"), "0000:0000:0000:0000")?;
        write(&ibdev_dir.join("ports/1/state"), "4: ACTIVE")?;
        write(&ibdev_dir.join("ports/1/phys_state"), "5: LinkUp")?;
        write(&ibdev_dir.join("ports/1/link_layer"), "Unknown")?;
        write(&ibdev_dir.join("ports/1/rate"), "100 Gb/sec (4X EDR)")?;
        for counter in PORT_COUNTERS {
            write(&ibdev_dir.join("ports/1/hw_counters").join(counter), "0")?;
        }
        for counter in DEVICE_COUNTERS {
            write(&ibdev_dir.join("hw_counters").join(counter), "0")?;
        }
        link(&function, &ibdev_dir.join("device"))?;

        let uverbs_dir = function.join("infiniband_verbs").join(device.uverbs_name());
        fs::create_dir_all(&uverbs_dir)?;
        write(&uverbs_dir.join("dev"), &device.dev.to_string())?;
        write(&uverbs_dir.join("ibdev"), &device.ibdev)?;
        link(&function, &uverbs_dir.join("device"))?;

        if self.sysfs.join("class/infiniband").is_dir() {
            link(
                &ibdev_dir,
                &self.sysfs.join("class/infiniband").join(&device.ibdev),
            )?;
            link(
                &uverbs_dir,
                &self
                    .sysfs
                    .join("class/infiniband_verbs")
                    .join(device.uverbs_name()),
            )?;
        }
        self.create_node(device)
    }

    /// Takes the device away as a driver unbind or hot-unplug would: sysfs entries and node.
    pub fn remove(&self, device: &FakeDevice) -> io::Result<()> {
        let _ = fs::remove_file(self.sysfs.join("class/infiniband").join(&device.ibdev));
        let _ = fs::remove_file(
            self.sysfs
                .join("class/infiniband_verbs")
                .join(device.uverbs_name()),
        );
        self.unbind(device)?;
        fs::remove_dir_all(self.function_dir(device))?;
        self.remove_node(device)
    }

    /// Binds the PCI function to its driver: `driver` link and the driver's back link.
    pub fn bind(&self, device: &FakeDevice) -> io::Result<()> {
        let function = self.function_dir(device);
        let driver_dir = self.sysfs.join("bus/pci/drivers").join(&device.driver);
        fs::create_dir_all(&driver_dir)?;
        link(&driver_dir, &function.join("driver"))?;
        link(&function, &driver_dir.join(&device.bdf))
    }

    pub fn unbind(&self, device: &FakeDevice) -> io::Result<()> {
        let driver_dir = self.sysfs.join("bus/pci/drivers").join(&device.driver);
        let _ = fs::remove_file(driver_dir.join(&device.bdf));
        match fs::remove_file(self.function_dir(device).join("driver")) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        }
    }

    pub fn node_path(&self, device: &FakeDevice) -> PathBuf {
        self.dev.join("infiniband").join(device.uverbs_name())
    }

    pub fn create_node(&self, device: &FakeDevice) -> io::Result<()> {
        let path = self.node_path(device);
        fs::create_dir_all(self.dev.join("infiniband"))?;
        let _ = fs::remove_file(&path);
        match self.nodes {
            Nodes::Files => fs::write(&path, b""),
            Nodes::CharDevices => make_char_device(&path, device.dev),
        }
    }

    pub fn remove_node(&self, device: &FakeDevice) -> io::Result<()> {
        match fs::remove_file(self.node_path(device)) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        }
    }

    /// Sets a port counter, as traffic through the device would.
    pub fn set_port_counter(
        &self,
        device: &FakeDevice,
        counter: &str,
        value: u64,
    ) -> io::Result<()> {
        let path = self
            .function_dir(device)
            .join("infiniband")
            .join(&device.ibdev)
            .join("ports/1/hw_counters")
            .join(counter);
        write(&path, &value.to_string())
    }
}

/// Creates a character device node with the given number.
pub fn make_char_device(path: &Path, dev: DevNum) -> io::Result<()> {
    use nix::sys::stat::{Mode, SFlag, makedev, mknod};
    mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(dev.major.into(), dev.minor.into()),
    )
    .map_err(io::Error::from)
}

fn write(path: &Path, text: &str) -> io::Result<()> {
    fs::write(path, format!("{text}\n"))
}

/// A relative symlink at `at` pointing to `target`, as sysfs makes them.
fn link(target: &Path, at: &Path) -> io::Result<()> {
    let _ = fs::remove_file(at);
    std::os::unix::fs::symlink(relative(target, at.parent().unwrap_or(Path::new("/"))), at)
}

fn relative(target: &Path, from_dir: &Path) -> PathBuf {
    let target: Vec<Component> = target.components().collect();
    let from: Vec<Component> = from_dir.components().collect();
    // Like the kernel's links, the path always ends in the target's own name, even when the
    // target is an ancestor (`device -> ../../../0000:10:1b.0`).
    let common = target
        .iter()
        .zip(&from)
        .take_while(|(a, b)| a == b)
        .count()
        .min(target.len().saturating_sub(1));
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for part in &target[common..] {
        path.push(part);
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn efa_matches_what_a_scan_of_the_tree_reads() {
        for shape in [
            Shape::P4d,
            Shape::P5,
            Shape::P6B200,
            Shape::G5,
            Shape::Dense256,
        ] {
            let root = tempfile::tempdir().unwrap();
            let (node, devices) = FakeNode::build(root.path(), shape, Nodes::Files).unwrap();
            let mut expected: Vec<Efa> = devices
                .iter()
                .filter(|d| d.is_efa())
                .map(FakeDevice::efa)
                .collect();
            expected.sort_by(|a, b| a.pci_address.cmp(&b.pci_address));
            let scan = crate::discovery::scan(&node.sysfs, DeviceIdStrategy::default());
            assert!(scan.problems.is_empty(), "{shape:?}: {:?}", scan.problems);
            assert_eq!(scan.devices, expected, "{shape:?}");
        }
    }
}
