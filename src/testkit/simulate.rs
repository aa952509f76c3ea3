//! Simulated nodes: sysfs and dev trees laid out the way the kernel lays them out, symlinks
//! included, for the demo and the tests.
//!
//! Each shape follows a real instance family, with its source next to its layout in
//! [`devices`]: p4d (4 EFAs on 4 PCIe roots, 2 NUMA nodes), p5 (32 EFAs on their real buses, 4
//! per GPU switch), p5en (16, 2 per switch), p6-b200 (8 EFAs plus 2 mlx5 `ibp*` decoys), p6-b300
//! (16), p6e-gb200 (17 on Grace, one PCI domain per GPU), trn2 and trn3 (16 on their published
//! buses, 2 per switch), g7 (2 on distant buses), hpc7g (1), Bottlerocket's `efa_N` names, g5
//! (NUMA -1), nodes with no EFA, and a 256-device node whose later uverbs nodes have a dynamic
//! major. Where a layout detail is not public, the comment there says what is assumed.
//!
//! Every device carries what a current efa driver writes (amzn-drivers
//! `kernel/linux/efa/RELEASENOTES.md`): a non-zero `node_guid` (r2.12), `device/p2p` naming the
//! first peer-to-peer provider, `NVIDIA` on GPU instances and empty elsewhere, and on Nitro v4
//! and later the port counters r2.17.0 added.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::discovery::{DevNum, DeviceIdStrategy, Efa};
use crate::health::Judge;
use crate::state::{DeviceRecord, Inventory, Verdict};

/// The kernel's static uverbs major; the first 32 nodes use minors from 192.
const UVERBS_MAJOR: u32 = 231;
const UVERBS_FIRST_MINOR: u32 = 192;
const UVERBS_STATIC_COUNT: u32 = 32;
/// A dynamic major, as the kernel hands out for uverbs nodes past the first 32.
const DYNAMIC_MAJOR: u32 = 511;

pub(crate) const EFA_VENDOR: &str = "0x1d0f";
const MLX5_VENDOR: &str = "0x15b3";

/// Port counters every efa driver exposes under `ports/1/hw_counters` (`efa_verbs.c`).
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
];
/// The port counters amzn-drivers r2.17.0 added, shown on Nitro v4 and later only.
pub(crate) const NITRO_V4_PORT_COUNTERS: &[&str] = &[
    "retrans_bytes",
    "retrans_pkts",
    "retrans_timeout_events",
    "unresponsive_remote_events",
    "impaired_remote_conn_events",
];
/// Port counters the `0xefa4` shape adds: the RDMA work-request counters of the kernel's
/// `efa_verbs.c` port stats, among them `rdma_read_wr_err` and `rdma_write_wr_err`, which AWS's
/// EFA monitoring guide names. Driver 3.3.0's own new event counters are named by no public
/// source found, so they are not simulated.
pub(crate) const EFA4_PORT_COUNTERS: &[&str] = &[
    "rdma_read_wrs",
    "rdma_read_wr_err",
    "rdma_read_resp_bytes",
    "rdma_write_wrs",
    "rdma_write_wr_err",
    "rdma_write_recv_bytes",
];
/// PCI device ID of driver 3.3.0's new EFA generation (amzn-drivers r3.3.0 `efa_main.c`).
const EFA4_DEVICE: &str = "0xefa4";
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
    /// `node_guid` as sysfs prints it: four groups of four hex digits.
    pub node_guid: String,
    /// The content of `device/p2p`; `None` for a driver that does not write it.
    pub p2p: Option<String>,
    /// The device sits on Nitro v4 or later, so its port shows [`NITRO_V4_PORT_COUNTERS`] too.
    pub nitro_v4: bool,
}

impl FakeDevice {
    pub fn uverbs_name(&self) -> String {
        format!("uverbs{}", self.uverbs)
    }

    pub fn is_efa(&self) -> bool {
        self.driver == "efa"
    }

    /// The files under `ports/1/hw_counters`.
    pub fn port_counters(&self) -> impl Iterator<Item = &'static str> {
        let newer: &[&str] = if self.nitro_v4 {
            NITRO_V4_PORT_COUNTERS
        } else {
            &[]
        };
        let efa4: &[&str] = if self.device == EFA4_DEVICE {
            EFA4_PORT_COUNTERS
        } else {
            &[]
        };
        PORT_COUNTERS.iter().chain(newer).chain(efa4).copied()
    }

    /// `ports/1/rate` as ib_core prints it: 4X EDR for every EFA generation before `0xefa4`,
    /// whose ports driver 3.3.0 reports at 1600 Gb/s (8 lanes of `IB_SPEED_XDR`).
    pub fn rate(&self) -> &'static str {
        if self.device == EFA4_DEVICE {
            "1600 Gb/sec (8X XDR)"
        } else {
            "100 Gb/sec (4X EDR)"
        }
    }

    /// Every counter file: the port's, then the device's own.
    pub fn counters(&self) -> impl Iterator<Item = &'static str> {
        self.port_counters().chain(DEVICE_COUNTERS.iter().copied())
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
    P6B300,
    /// p6-b300 with EFA driver 3.3.0's generation of device: PCI device `0xefa4`, ports at
    /// 1600 Gb/s, and the work-request counters of [`EFA4_PORT_COUNTERS`]. Sources are weak:
    /// rdma-core PR #1760 and amzn-drivers r3.3.0 for the ID; for the 800 and 1600 Gb/s rates
    /// (`IB_SPEED_XDR`), third-party notes on amzn-drivers commits bf83e44, a1e35dc and 44c91d1.
    /// Which instances carry `0xefa4` is not public; p6-b300, the newest EFA instance, stands in.
    P6B300Efa4,
    /// p6e-gb200.36xlarge, arm64 (Grace).
    P6eGb200,
    Trn2,
    Trn3,
    G7,
    /// hpc7g, arm64 (Graviton3E).
    Hpc7g,
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

impl Shape {
    /// Every shape, `Dense(n)` once with a partly filled root, for tests that must hold on each.
    pub const ALL: [Shape; 17] = [
        Shape::P4d,
        Shape::P5,
        Shape::P5en,
        Shape::P6B200,
        Shape::P6B300,
        Shape::P6B300Efa4,
        Shape::P6eGb200,
        Shape::Trn2,
        Shape::Trn3,
        Shape::G7,
        Shape::Hpc7g,
        Shape::Bottlerocket,
        Shape::G5,
        Shape::NoEfa,
        Shape::NoClassDir,
        Shape::Dense256,
        Shape::Dense(40),
    ];

    /// GPU instances, where NVIDIA's is the efa driver's P2P provider. Elsewhere `device/p2p` is
    /// empty; whether Neuron registers a provider on Trainium is not public, so it stays empty
    /// there too.
    fn has_gpus(self) -> bool {
        matches!(
            self,
            Shape::P4d
                | Shape::P5
                | Shape::P5en
                | Shape::P6B200
                | Shape::P6B300
                | Shape::P6B300Efa4
                | Shape::P6eGb200
                | Shape::G7
                | Shape::Bottlerocket
                | Shape::G5
        )
    }

    /// Nitro v4 or later. No public list ties families to the counters, so this is assumed from
    /// launch dates: p4d (2020) and g5 (2021) before v4, every family here since p5 (2023) after.
    fn nitro_v4(self) -> bool {
        !matches!(self, Shape::P4d | Shape::Bottlerocket | Shape::G5)
    }
}

/// The EFA of each Neuron device of a trn2.48xlarge, by bus (aws-neuron/
/// connected-device-maps-over-efa-for-neuron `lookup/neuron/trn2.json`, all `0000:<bus>:00.0`).
const TRN2_EFA_BUSES: [u32; 16] = [
    0xc9, 0xb4, 0xb3, 0xca, 0x6c, 0x57, 0x56, 0x6d, 0x98, 0x83, 0x82, 0x99, 0xf5, 0xe0, 0xdf, 0xf6,
];
/// The same for trn3.48xlarge (`lookup/neuron/trn3.json` there).
const TRN3_EFA_BUSES: [u32; 16] = [
    0xbe, 0xa9, 0xa8, 0xbf, 0x61, 0x4c, 0x4b, 0x62, 0x8d, 0x78, 0x77, 0x8e, 0xea, 0xd5, 0xd4, 0xeb,
];

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

/// A node GUID as sysfs prints it, unique to the PCI location: the driver reads a real one
/// from the device, never zero since r2.12.
fn node_guid(vendor_tag: u32, domain: u32, bus: u32, slot: u32) -> String {
    format!("{vendor_tag:04x}:{domain:04x}:{bus:04x}:{slot:02x}01")
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
        node_guid: node_guid(0x0aef, domain, bus, slot),
        p2p: Some(String::new()),
        nitro_v4: true,
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

/// `count` EFAs at slot 0 of the buses from `first_bus` on, behind one switch: the bridges of
/// [`switched_root`], whose layout puts the first EFA three buses below the root.
fn switch_at(
    domain: u32,
    first_bus: u32,
    count: u32,
    numa: i32,
    first_uverbs: u32,
) -> Vec<FakeDevice> {
    switched_root(domain, first_bus - 3, count, numa, first_uverbs)
}

/// A Trainium node from its table of EFA buses, one per Neuron device: 8 PCIe switches × 2
/// EFAs (kvcache-ai/Mooncake PR #3888 for trn2). Assumed where nothing is public: the two EFAs
/// of a switch are the adjacent buses, Neuron devices 0–7 sit on NUMA node 0 and 8–15 on 1, and
/// uverbs numbers follow ascending bus as on p5.
fn trainium(buses: &[u32; 16]) -> Vec<FakeDevice> {
    let mut sorted = *buses;
    sorted.sort_unstable();
    sorted
        .chunks(2)
        .enumerate()
        .flat_map(|(s, pair)| {
            assert_eq!(
                pair[1],
                pair[0] + 1,
                "a switch's EFAs sit on adjacent buses"
            );
            let neuron = buses.iter().position(|b| *b == pair[0]).unwrap_or(0);
            let numa = if neuron < 8 { 0 } else { 1 };
            switch_at(0, pair[0], 2, numa, 2 * s as u32)
        })
        .collect()
}

/// The devices of a shape, EFAs and decoys alike.
pub fn devices(shape: Shape) -> Vec<FakeDevice> {
    let mut all = layout(shape);
    for device in all.iter_mut().filter(|d| d.is_efa()) {
        device.nitro_v4 = shape.nitro_v4();
        if shape.has_gpus() {
            device.p2p = Some("NVIDIA".into());
        }
    }
    all
}

fn layout(shape: Shape) -> Vec<FakeDevice> {
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
        // Eight GPU PCIe switches of 4 EFAs each, at slot 0 of buses 0x4f–0x52, 0x60–0x63, …,
        // 0xc6–0xc9: aws-ofi-nccl `topology/p5.48xl-topo.xml` names them `rdmap79s0` …
        // `rdmap201s0` (its bus IDs are synthetic; the names carry the real bus), and
        // `rdmap79s0` is `0000:4f:00.0` on NUMA node 0 next to GPU0 at `0000:53:00.0` (a weak
        // report: an excerpt without its repository; GPUs are not simulated). uverbs
        // numbers follow ascending bus (eks-charts PR #1110/#1144 logs), which is not name
        // order: `rdmap113s0` sorts first. Assumed: switches 0–3 on NUMA node 0, 4–7 on 1, and
        // the bridges above each switch.
        Shape::P5 => (0..8u32)
            .flat_map(|s| switch_at(0, 0x4f + s * 0x11, 4, (s / 4) as i32, s * 4))
            .collect(),
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
        // "16 EFA devices per node" (SemiAnalysisAI/InferenceX PR #2979). Assumed, as nothing
        // more is public: 2 per GPU switch as on p5en, on p5's buses, switches 0–3 on NUMA node
        // 0, and no mlx5 devices beside them (only p6-b200's are reported).
        Shape::P6B300 => (0..8u32)
            .flat_map(|s| switch_at(0, 0x4f + s * 0x11, 2, (s / 4) as i32, s * 2))
            .collect(),
        Shape::P6B300Efa4 => layout(Shape::P6B300)
            .into_iter()
            .map(|device| FakeDevice {
                device: EFA4_DEVICE.into(),
                ..device
            })
            .collect(),
        // Grace with 4 GPUs and "up to 17 network cards" (NVIDIA/nodewright-packages PR #94).
        // Assumed: one EFA per card (node-efa.adoc's upper bound), so 17: card 0 alone on the
        // first Grace's root, and 4 behind each GPU's switch, every root in its own PCI domain
        // as arm64 servers number them, GPUs 0–1 on NUMA node 0 and 2–3 on 1.
        Shape::P6eGb200 => {
            let card0 = efa(
                0,
                0x01,
                0,
                vec!["pci0000:00".into(), "0000:00:01.0".into()],
                0,
                0,
            );
            let mut all = vec![card0];
            all.extend(
                (0..4u32).flat_map(|g| switch_at(g + 1, 0x03, 4, (g / 2) as i32, 1 + g * 4)),
            );
            all
        }
        Shape::Trn2 => trainium(&TRN2_EFA_BUSES),
        Shape::Trn3 => trainium(&TRN3_EFA_BUSES),
        // `rdmap83s0` and `rdmap176s0`, far apart (a weak report, noted in the facts). Assumed:
        // each behind a GPU switch of its own, one per NUMA node.
        Shape::G7 => [(0x53, 0), (0xb0, 1)]
            .into_iter()
            .enumerate()
            .flat_map(|(i, (bus, numa))| switch_at(0, bus, 1, numa, i as u32))
            .collect(),
        // One EFA, `rdmap0s6` (eksctl PR #6743): slot 6 of the root bus, on Graviton's one NUMA
        // node.
        Shape::Hpc7g => vec![efa(0, 0x00, 0x06, vec!["pci0000:00".into()], 0, 0)],
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
        node_guid: node_guid(0xb83f, 0, bus, 0),
        // `p2p` is the efa driver's attribute; mlx5 has none.
        p2p: None,
        nitro_v4: false,
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
    /// How the plugin judges this node's devices: with [`Nodes::Files`], a regular file stands
    /// in for the character device.
    pub fn judge(&self) -> Judge {
        Judge::new(self.dev.clone()).accepting_regular_files(matches!(self.nodes, Nodes::Files))
    }

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
        let all = node.lay_out(shape)?;
        Ok((node, all))
    }

    /// Lays out `shape` at this node's sysfs and dev, which may be apart (a cluster node's
    /// tree beside the host's real `/dev`).
    pub fn lay_out(&self, shape: Shape) -> io::Result<Vec<FakeDevice>> {
        fs::create_dir_all(self.sysfs.join("devices"))?;
        fs::create_dir_all(&self.dev)?;
        if shape != Shape::NoClassDir {
            fs::create_dir_all(self.sysfs.join("class/infiniband"))?;
            fs::create_dir_all(self.sysfs.join("class/infiniband_verbs"))?;
        }
        let all = devices(shape);
        for device in &all {
            self.add(device)?;
        }
        self.set_rdma_netns_mode(Some("Y"))?;
        Ok(all)
    }

    /// Writes ib_core's `netns_mode` parameter as the kernel shows it (`Y` shared, the
    /// default; `N` after `rdma system set netns exclusive`), or removes it (`None`), as on a
    /// node where `ib_core` is not loaded.
    pub fn set_rdma_netns_mode(&self, mode: Option<&str>) -> io::Result<()> {
        let dir = self.sysfs.join("module/ib_core/parameters");
        match mode {
            Some(mode) => {
                fs::create_dir_all(&dir)?;
                write(&dir.join("netns_mode"), mode)
            }
            None => match fs::remove_file(dir.join("netns_mode")) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            },
        }
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

        let ibdev_dir = self.ibdev_dir(device);
        fs::create_dir_all(ibdev_dir.join("ports/1/hw_counters"))?;
        fs::create_dir_all(ibdev_dir.join("hw_counters"))?;
        write(&ibdev_dir.join("node_type"), "7: unspecified")?;
        write(&ibdev_dir.join("node_guid"), &device.node_guid)?;
        write(&ibdev_dir.join("ports/1/state"), "4: ACTIVE")?;
        write(&ibdev_dir.join("ports/1/phys_state"), "5: LinkUp")?;
        write(&ibdev_dir.join("ports/1/link_layer"), "Unknown")?;
        write(&ibdev_dir.join("ports/1/rate"), device.rate())?;
        if let Some(p2p) = &device.p2p {
            write(&function.join("p2p"), p2p)?;
        }
        for counter in device.port_counters() {
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

    /// Gives the device the ibdev name `to`, as udev does right after the driver registers it
    /// and `rdma dev set` does later: same PCI function and uverbs node, another class entry.
    pub fn rename(&self, device: &FakeDevice, to: &str) -> io::Result<FakeDevice> {
        let renamed = FakeDevice {
            ibdev: to.to_owned(),
            ..device.clone()
        };
        let function = self.function_dir(device);
        fs::rename(
            function.join("infiniband").join(&device.ibdev),
            function.join("infiniband").join(to),
        )?;
        let class = self.sysfs.join("class/infiniband");
        fs::remove_file(class.join(&device.ibdev))?;
        link(&function.join("infiniband").join(to), &class.join(to))?;
        write(
            &function
                .join("infiniband_verbs")
                .join(device.uverbs_name())
                .join("ibdev"),
            to,
        )?;
        Ok(renamed)
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

    /// Sets a device-level counter under `hw_counters`, as the driver's admin queue would
    /// (`no_completion_cmds` for a command that got no completion).
    pub fn set_device_counter(
        &self,
        device: &FakeDevice,
        counter: &str,
        value: u64,
    ) -> io::Result<()> {
        let path = self.ibdev_dir(device).join("hw_counters").join(counter);
        write(&path, &value.to_string())
    }

    /// Sets a port counter, as traffic through the device would.
    pub fn set_port_counter(
        &self,
        device: &FakeDevice,
        counter: &str,
        value: u64,
    ) -> io::Result<()> {
        let path = self
            .ibdev_dir(device)
            .join("ports/1/hw_counters")
            .join(counter);
        write(&path, &value.to_string())
    }

    /// The device's RDMA entry below its PCI function, where the class entry links to.
    fn ibdev_dir(&self, device: &FakeDevice) -> PathBuf {
        self.function_dir(device)
            .join("infiniband")
            .join(&device.ibdev)
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
    .map_err(io::Error::from)?;
    // mknod applies the umask; rdma-core's udev rule leaves uverbs nodes 0666.
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o666))
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
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    #[test]
    fn efa_matches_what_a_scan_of_the_tree_reads() {
        for shape in Shape::ALL {
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

    /// The EFAs of a shape in uverbs order.
    fn efas_of(shape: Shape) -> Vec<FakeDevice> {
        let mut efas: Vec<FakeDevice> = devices(shape).into_iter().filter(|d| d.is_efa()).collect();
        efas.sort_by_key(|d| d.uverbs);
        efas
    }

    /// uverbs numbers by the switch (the bridges above the downstream port) they sit behind.
    fn switches(efas: &[FakeDevice]) -> BTreeMap<String, Vec<u32>> {
        let mut by_switch: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for d in efas {
            let upstream = d.parents[..d.parents.len() - 1].join("/");
            by_switch.entry(upstream).or_default().push(d.uverbs);
        }
        by_switch
    }

    #[test]
    fn p5_has_the_real_names_buses_and_uverbs_order() {
        let efas = efas_of(Shape::P5);
        let names: Vec<&str> = efas.iter().map(|d| d.ibdev.as_str()).collect();
        let want: Vec<String> = [79, 96, 113, 130, 147, 164, 181, 198]
            .into_iter()
            .flat_map(|first| (first..first + 4).map(|bus| format!("rdmap{bus}s0")))
            .collect();
        assert_eq!(names, want);
        assert_eq!(efas[0].bdf, "0000:4f:00.0");
        assert_eq!(efas[4].bdf, "0000:60:00.0");
        assert_eq!(efas[31].bdf, "0000:c9:00.0");
        // uverbs in ascending bus: sorted by address is sorted by uverbs number.
        let mut by_address = efas.clone();
        by_address.sort_by(|a, b| a.bdf.cmp(&b.bdf));
        assert_eq!(by_address, efas);
        let groups = switches(&efas);
        assert_eq!(groups.len(), 8);
        assert!(groups.values().all(|g| g.len() == 4), "{groups:?}");
    }

    #[test]
    fn trainium_efas_sit_at_their_published_addresses_two_per_switch() {
        for (shape, table) in [(Shape::Trn2, TRN2_EFA_BUSES), (Shape::Trn3, TRN3_EFA_BUSES)] {
            let efas = efas_of(shape);
            let have: BTreeSet<&str> = efas.iter().map(|d| d.bdf.as_str()).collect();
            let want: Vec<String> = table.iter().map(|b| format!("0000:{b:02x}:00.0")).collect();
            assert_eq!(have, want.iter().map(String::as_str).collect(), "{shape:?}");
            let groups = switches(&efas);
            assert_eq!(groups.len(), 8, "{shape:?}");
            assert!(
                groups.values().all(|g| g.len() == 2),
                "{shape:?}: {groups:?}"
            );
        }
        // Neuron device 0's EFA on trn2 (`0000:c9:00.0`), by its rdma-core name.
        assert!(efas_of(Shape::Trn2).iter().any(|d| d.ibdev == "rdmap201s0"));
    }

    #[test]
    fn efa4_devices_show_driver_3_3_identity_rate_and_counters_in_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let (node, devices) = FakeNode::build(dir.path(), Shape::P6B300Efa4, Nodes::Files).unwrap();
        assert_eq!(devices.len(), 16);
        let class = node.sysfs.join("class/infiniband").join(&devices[0].ibdev);
        let read = |rel: &str| fs::read_to_string(class.join(rel)).unwrap();
        assert_eq!(read("device/device"), "0xefa4\n");
        assert_eq!(read("ports/1/rate"), "1600 Gb/sec (8X XDR)\n");
        for counter in [
            "rdma_read_wr_err",
            "rdma_write_wr_err",
            "retrans_timeout_events",
        ] {
            assert_eq!(read(&format!("ports/1/hw_counters/{counter}")), "0\n");
        }
        // Older generations keep their rate and counters.
        let p6b300 = &efas_of(Shape::P6B300)[0];
        assert_eq!(p6b300.rate(), "100 Gb/sec (4X EDR)");
        assert!(!p6b300.port_counters().any(|c| c == "rdma_read_wr_err"));
    }

    #[test]
    fn g7_hpc7g_and_gb200_layouts() {
        let g7: Vec<String> = efas_of(Shape::G7).into_iter().map(|d| d.ibdev).collect();
        assert_eq!(g7, ["rdmap83s0", "rdmap176s0"]);
        let hpc7g: Vec<String> = efas_of(Shape::Hpc7g).into_iter().map(|d| d.ibdev).collect();
        assert_eq!(hpc7g, ["rdmap0s6"]);
        let gb200 = efas_of(Shape::P6eGb200);
        assert_eq!(gb200.len(), 17);
        let domains: BTreeSet<&str> = gb200.iter().map(|d| &d.bdf[..4]).collect();
        assert_eq!(domains.len(), 5, "card 0 and one domain per GPU");
        assert!(gb200.iter().any(|d| d.ibdev == "rdmaP1p3s0"));
    }

    /// Every fixture carries what a current efa driver writes, read back from the tree.
    #[test]
    fn every_efa_has_a_node_guid_its_p2p_provider_and_its_generations_counters() {
        for shape in Shape::ALL {
            let root = tempfile::tempdir().unwrap();
            let (node, devices) = FakeNode::build(root.path(), shape, Nodes::Files).unwrap();
            let mut guids = BTreeSet::new();
            for d in devices.iter().filter(|d| d.is_efa()) {
                let ibdev = node.sysfs.join("class/infiniband").join(&d.ibdev);
                let read = |rel: &str| fs::read_to_string(ibdev.join(rel)).unwrap();
                let guid = read("node_guid");
                assert_ne!(guid.trim(), "0000:0000:0000:0000", "{shape:?} {}", d.ibdev);
                assert_eq!(guid.trim().len(), 19, "{guid}");
                assert!(guids.insert(guid), "{shape:?}: {} repeats a GUID", d.ibdev);
                let p2p = read("device/p2p");
                let want = if shape.has_gpus() { "NVIDIA" } else { "" };
                assert_eq!(p2p.trim_end(), want, "{shape:?} {}", d.ibdev);
                for counter in NITRO_V4_PORT_COUNTERS {
                    let path = ibdev.join("ports/1/hw_counters").join(counter);
                    assert_eq!(path.exists(), shape.nitro_v4(), "{shape:?} {counter}");
                }
            }
        }
    }
}
