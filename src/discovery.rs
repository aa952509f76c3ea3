//! Finds the node's EFA devices in sysfs.
//!
//! An EFA is an entry of `<sysfs>/class/infiniband` whose PCI function is bound to the `efa`
//! driver; every other RDMA device (mlx5 `ibp*` on p6-b200, for one) is ignored. Nothing here is
//! derived from `/sys/class/net`: EFA-only interfaces have no netdev.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The kernel driver name that marks an RDMA device as an EFA.
pub(crate) const EFA_DRIVER: &str = "efa";

/// A character device number as the kernel prints it in a `dev` file (`major:minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

impl std::str::FromStr for DevNum {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let (major, minor) = text
            .split_once(':')
            .ok_or_else(|| format!("expected major:minor, got {text:?}"))?;
        let number = |part: &str| {
            part.parse::<u32>()
                .map_err(|_| format!("expected major:minor, got {text:?}"))
        };
        Ok(DevNum {
            major: number(major)?,
            minor: number(minor)?,
        })
    }
}

/// Which of an EFA's names the kubelet knows it by.
#[derive(clap::ValueEnum, serde::Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceIdStrategy {
    /// The RDMA device name, as the AWS plugin advertises it and CloudWatch looks it up: pods
    /// keep their EFAs across a switch between the two plugins.
    #[default]
    Ibdev,
    /// The PCI address: also stable across OS images that name RDMA devices differently.
    Pci,
}

/// One EFA as sysfs describes it at the time of a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Efa {
    /// The ID the kubelet knows the EFA by: its `ibdev` or its `pci_address`, by strategy.
    pub id: String,
    /// PCI address (`0000:10:1b.0`): stable across restarts, reboots and ibdev renames.
    pub pci_address: String,
    /// RDMA device name: `efa_0` on Bottlerocket, `rdmap16s27` on AL2023.
    pub ibdev: String,
    /// uverbs node name, e.g. `uverbs3`; the container sees `/dev/infiniband/<uverbs>`.
    pub uverbs: String,
    /// Read from sysfs, never computed: past 32 devices the major is dynamic.
    pub dev: DevNum,
    /// `None` when the platform reports `-1` (g5 and older).
    pub numa_node: Option<u32>,
    /// Path of the PCI function below `<sysfs>/devices`, e.g. `pci0000:10/0000:10:01.0/0000:10:1b.0`.
    /// Devices whose paths share a longer prefix sit closer on the PCIe fabric.
    pub pci_path: String,
    pub vendor: String,
    pub device: String,
}

impl Efa {
    /// Where the device's node lives on the host: `<dev-root>/infiniband/<uverbs>`.
    pub fn node_path(&self, dev_root: &Path) -> PathBuf {
        dev_root.join("infiniband").join(&self.uverbs)
    }
}

/// An `infiniband` entry that looked like an EFA but could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub entry: String,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.entry, self.reason)
    }
}

/// The result of one pass over `<sysfs>/class/infiniband`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    /// Sorted by PCI address.
    pub devices: Vec<Efa>,
    /// Entries that look like an EFA but could not be read, sorted by entry (the ibdev).
    pub problems: Vec<Problem>,
    /// EFAs kept without NUMA affinity because `numa_node` could not be read.
    pub numa_unreadable: Vec<Problem>,
    /// Why the class directory could not be listed at all: the pass saw nothing, which is not
    /// the same as a node without EFAs.
    pub failed: Option<ListingError>,
}

/// A failed listing of `<sysfs>/class/infiniband`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListingError {
    /// The errno's name (`EMFILE`, `EACCES`, ...): few values, so fit for a metric label.
    pub code: String,
    pub message: String,
}

/// The ibdevs whose attributes are being read right now, across passes. A read stuck in the
/// kernel stays listed; later passes skip that entry instead of blocking a thread on it too.
#[derive(Debug, Default)]
pub(crate) struct Reads(Mutex<BTreeSet<String>>);

impl Reads {
    /// The entries being read now.
    pub(crate) fn in_flight(&self) -> BTreeSet<String> {
        self.lock().clone()
    }

    /// Marks `ibdev` as being read; false when an earlier read of it has not returned.
    pub(crate) fn begin(&self, ibdev: &str) -> bool {
        self.lock().insert(ibdev.to_owned())
    }

    pub(crate) fn end(&self, ibdev: &str) {
        self.lock().remove(ibdev);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why an entry is not read while an earlier read of it has not returned.
pub(crate) const STILL_READING: &str = "an earlier read of its sysfs attributes has not returned";

/// Reads every EFA below `sysfs_root`, each with its ID under `ids`. A missing class directory
/// means no EFA, not an error: the driver may load after the plugin starts.
pub fn scan(sysfs_root: &Path, ids: DeviceIdStrategy) -> Scan {
    scan_guarded(sysfs_root, ids, &Reads::default())
}

/// [`scan`], skipping the entries that `reads` says are still being read by an earlier pass.
pub(crate) fn scan_guarded(sysfs_root: &Path, ids: DeviceIdStrategy, reads: &Reads) -> Scan {
    let class = sysfs_root.join("class/infiniband");
    let mut result = Scan::default();
    let entries = match fs::read_dir(&class) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return result,
        Err(err) => {
            result.failed = Some(ListingError {
                code: errno_name(&err),
                message: format!("{}: {err}", class.display()),
            });
            return result;
        }
    };
    let devices_dir = fold(&sysfs_root.join("devices"));
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        match driver_of(&dir) {
            Some(driver) if driver == EFA_DRIVER => {}
            _ => continue,
        }
        let ibdev = match usable_name(&entry.file_name()) {
            Ok(ibdev) => ibdev,
            Err(problem) => {
                result.problems.push(problem);
                continue;
            }
        };
        if !reads.begin(&ibdev) {
            result.problems.push(Problem {
                entry: ibdev,
                reason: STILL_READING.into(),
            });
            continue;
        }
        let read = read_efa(&devices_dir, &dir, &ibdev, ids);
        reads.end(&ibdev);
        match read {
            Ok((efa, numa)) => {
                if let Err(reason) = numa {
                    result.numa_unreadable.push(Problem {
                        entry: ibdev.clone(),
                        reason,
                    });
                }
                let kernels = is_kernels_entry(&dir, &ibdev);
                found.push((efa, kernels));
            }
            Err(reason) => result.problems.push(Problem {
                entry: ibdev,
                reason,
            }),
        }
    }
    let (devices, twins) = one_entry_per_function(found);
    result.devices = devices;
    result.problems.extend(twins);
    result.problems.sort_by(|a, b| a.entry.cmp(&b.entry));
    result
}

/// Whether the class entry `dir` is the kernel's own name for its device: the entry the kernel
/// makes links to `<function>/infiniband/<ibdev>`, so the link's last part is the entry's name.
fn is_kernels_entry(dir: &Path, ibdev: &str) -> bool {
    fs::read_link(dir).is_ok_and(|target| target.file_name() == Some(std::ffi::OsStr::new(ibdev)))
}

/// The devices sorted by PCI address, one per PCI function, and the entries left out. The
/// kernel makes one class entry per function; a second (a hand-made link, a broken udev rule)
/// would advertise one uverbs node under two IDs, and the kubelet would give it to two pods. The
/// kernel's own entry is kept, else the first by name.
fn one_entry_per_function(mut found: Vec<(Efa, bool)>) -> (Vec<Efa>, Vec<Problem>) {
    found.sort_by(|(a, a_kernels), (b, b_kernels)| {
        (&a.pci_address, !a_kernels, &a.ibdev).cmp(&(&b.pci_address, !b_kernels, &b.ibdev))
    });
    let mut devices: Vec<Efa> = Vec::with_capacity(found.len());
    let mut twins = Vec::new();
    for (efa, _) in found {
        match devices.last() {
            Some(kept) if kept.pci_address == efa.pci_address => twins.push(Problem {
                reason: format!(
                    "it names the PCI function {} that the entry {} names already; left out, as \
                     the kernel makes one entry per function (a hand-made link or a udev rule?)",
                    efa.pci_address, kept.ibdev
                ),
                entry: efa.ibdev,
            }),
            _ => devices.push(efa),
        }
    }
    (devices, twins)
}

/// The ibdev name as the plugin may use it, or why the entry is refused. The name becomes a
/// device ID (in the ibdev strategy), a metric label and a key of the PodResources view, so it
/// must stay what it is: a lossy conversion would give two names that differ only in invalid
/// bytes one ID, and drop one EFA unseen. The kubelet's device IDs are protobuf strings, which
/// must be UTF-8; `::` is the separator of a replica number (sharing's), so a name holding it
/// would be read as another name's replica; and a control character would break the log line
/// and the label that carry it. The kernel's own names (`rdmap16s27`,
/// `efa_0`) have none of these: only a rename by hand can.
/// Sharing's separator, spelled here too: sharing builds on discovery, not the other way.
const REPLICA_SEPARATOR: &str = "::";

fn usable_name(name: &std::ffi::OsStr) -> Result<String, Problem> {
    let refuse = |reason: &str| Problem {
        entry: format!("{name:?}"),
        reason: reason.to_owned(),
    };
    let Some(text) = name.to_str() else {
        return Err(refuse(
            "its name is not valid UTF-8, and a device ID must be; rename it (rdma dev set)",
        ));
    };
    if text.contains(REPLICA_SEPARATOR) {
        return Err(refuse(
            "its name contains `::`, which starts a replica number in a device ID; rename it (rdma dev set)",
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(refuse(
            "its name contains a control character; rename it (rdma dev set)",
        ));
    }
    Ok(text.to_owned())
}

fn errno_name(err: &io::Error) -> String {
    err.raw_os_error().map_or_else(
        || "EIO".to_owned(),
        |code| format!("{:?}", nix::errno::Errno::from_raw(code)),
    )
}

/// Basename of `<ibdev>/device/driver`, the kernel's own statement of which driver owns the device.
fn driver_of(ibdev_dir: &Path) -> Option<String> {
    let target = fs::read_link(ibdev_dir.join("device/driver")).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// The device, and whether its NUMA node could be read: an unreadable `numa_node` costs the
/// device its topology hint, not its place on the node.
type Read = (Efa, Result<(), String>);

fn read_efa(
    devices_dir: &Path,
    ibdev_dir: &Path,
    ibdev: &str,
    ids: DeviceIdStrategy,
) -> Result<Read, String> {
    let function_link =
        fs::read_link(ibdev_dir.join("device")).map_err(|err| format!("device link: {err}"))?;
    let pci_address = function_link
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .ok_or("device link has no file name")?;
    let pci_path = pci_path(devices_dir, ibdev_dir, &function_link)?;
    // Read through the path checked to be inside sysfs, not through the links again.
    let function = devices_dir.join(&pci_path);
    let uverbs = uverbs_of(&function)?;
    let dev = read_trimmed(&function.join("infiniband_verbs").join(&uverbs).join("dev"))?
        .parse::<DevNum>()
        .map_err(|err| format!("{uverbs}/dev: {err}"))?;
    let (numa_node, numa_read) = match attribute(&function.join("numa_node")) {
        Ok(text) => (parse_numa(&text)?, Ok(())),
        // Kernels built without NUMA support have no such file.
        Err(err) if err.kind() == io::ErrorKind::NotFound => (None, Ok(())),
        Err(err) => (None, Err(format!("numa_node: {err}"))),
    };
    let efa = Efa {
        pci_path,
        id: match ids {
            DeviceIdStrategy::Ibdev => ibdev.to_owned(),
            DeviceIdStrategy::Pci => pci_address.clone(),
        },
        pci_address,
        ibdev: ibdev.to_owned(),
        uverbs,
        dev,
        numa_node,
        vendor: read_trimmed(&function.join("vendor")).unwrap_or_default(),
        device: read_trimmed(&function.join("device")).unwrap_or_default(),
    };
    Ok((efa, numa_read))
}

fn uverbs_of(function: &Path) -> Result<String, String> {
    let dir = function.join("infiniband_verbs");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .map_err(|err| format!("infiniband_verbs: {err}"))?
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| is_uverbs_name(name))
        .collect();
    names.sort();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("infiniband_verbs holds no uverbs node".into()),
        many => Err(format!(
            "infiniband_verbs holds {} uverbs nodes: {}",
            many.len(),
            many.join(", ")
        )),
    }
}

/// `uverbs` and a decimal number, nothing else: the name becomes a path below the dev root.
fn is_uverbs_name(name: &str) -> bool {
    name.strip_prefix("uverbs")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_numa(text: &str) -> Result<Option<u32>, String> {
    let node: i64 = text
        .parse()
        .map_err(|_| format!("numa_node: not a number: {text:?}"))?;
    Ok(u32::try_from(node).ok())
}

/// The PCI function's path below `<sysfs>/devices`, resolved from the two links the kernel made
/// (`class/infiniband/<ibdev>` and its `device`) without touching the disk again: sysfs links
/// are relative, so `..` can be folded lexically. Scans run often, and a full `canonicalize`
/// costs a syscall per path component. A link that leads outside `<sysfs>/devices` is refused:
/// the kernel never makes one, and following it would read files sysfs does not own.
fn pci_path(
    devices_dir: &Path,
    class_entry: &Path,
    function_link: &Path,
) -> Result<String, String> {
    let ibdev_real = match fs::read_link(class_entry) {
        Ok(target) => fold(&class_entry.parent().unwrap_or(Path::new("/")).join(target)),
        Err(_) => fold(class_entry),
    };
    let function = fold(&ibdev_real.join(function_link));
    match function.strip_prefix(devices_dir) {
        Ok(below) if below.components().next().is_some() => {
            Ok(below.to_string_lossy().into_owned())
        }
        _ => Err(format!(
            "device link leads to {}, outside {}",
            function.display(),
            devices_dir.display()
        )),
    }
}

/// Removes `.` and folds `..` components without following links; a relative path keeps the
/// `..` it starts with (`../sys` stays `../sys`).
fn fold(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => match out.components().next_back() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => out.push(".."),
            },
            other => out.push(other),
        }
    }
    out
}

fn attribute(path: &Path) -> io::Result<String> {
    crate::fsread::read_text(path, crate::fsread::ATTRIBUTE_LIMIT)
        .map(|text| text.trim().to_owned())
}

fn read_trimmed(path: &Path) -> Result<String, String> {
    attribute(path).map_err(|err| format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::simulate::{self, FakeNode, Nodes, Shape};

    fn scan_shape(shape: Shape) -> (tempfile::TempDir, FakeNode, Scan) {
        let dir = tempfile::tempdir().unwrap();
        let (node, _) = FakeNode::build(dir.path(), shape, Nodes::Files).unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        (dir, node, found)
    }

    #[test]
    fn every_shape_yields_exactly_its_efas() {
        for shape in Shape::ALL {
            let (_dir, _node, found) = scan_shape(shape);
            let mut want: Vec<_> = simulate::devices(shape)
                .into_iter()
                .filter(|d| d.is_efa())
                .collect();
            want.sort_by(|a, b| a.bdf.cmp(&b.bdf));
            assert!(found.problems.is_empty(), "{shape:?}: {:?}", found.problems);
            assert_eq!(found.devices.len(), want.len(), "{shape:?}");
            for (efa, fake) in found.devices.iter().zip(&want) {
                assert_eq!(efa.id, fake.ibdev);
                assert_eq!(efa.pci_address, fake.bdf);
                assert_eq!(efa.ibdev, fake.ibdev);
                assert_eq!(efa.uverbs, fake.uverbs_name());
                assert_eq!(efa.dev, fake.dev);
                assert_eq!(efa.numa_node, u32::try_from(fake.numa).ok());
                assert_eq!(efa.vendor, "0x1d0f");
                assert!(efa.pci_path.ends_with(&fake.bdf), "{}", efa.pci_path);
                assert!(efa.pci_path.starts_with("pci"), "{}", efa.pci_path);
            }
        }
    }

    #[test]
    fn the_pci_strategy_names_each_efa_by_its_address() {
        let (_dir, node, by_ibdev) = scan_shape(Shape::P4d);
        let by_pci = scan(&node.sysfs, DeviceIdStrategy::Pci);
        assert_eq!(by_pci.devices.len(), 4);
        for (pci, ibdev) in by_pci.devices.iter().zip(&by_ibdev.devices) {
            assert_eq!(pci.id, pci.pci_address);
            assert_eq!(
                Efa {
                    id: ibdev.ibdev.clone(),
                    ..pci.clone()
                },
                *ibdev
            );
        }
    }

    #[test]
    fn p5_uverbs_numbers_are_not_in_name_order() {
        let (_dir, _node, found) = scan_shape(Shape::P5);
        let mut by_name = found.devices.clone();
        by_name.sort_by(|a, b| a.ibdev.cmp(&b.ibdev));
        // `rdmap113s0` (uverbs8) sorts before `rdmap79s0` (uverbs0).
        assert_eq!(by_name[0].ibdev, "rdmap113s0");
        let numbers: Vec<u32> = by_name
            .iter()
            .map(|d| d.uverbs.trim_start_matches("uverbs").parse().unwrap())
            .collect();
        let mut sorted = numbers.clone();
        sorted.sort();
        assert_ne!(numbers, sorted);
    }

    #[test]
    fn dense_node_keeps_the_dynamic_major_from_sysfs() {
        let (_dir, _node, found) = scan_shape(Shape::Dense256);
        assert_eq!(found.devices.len(), 256);
        assert!(found.devices.iter().any(|d| d.dev.major != 231));
        let mut numbers: Vec<DevNum> = found.devices.iter().map(|d| d.dev).collect();
        numbers.sort();
        numbers.dedup();
        assert_eq!(numbers.len(), 256);
    }

    #[test]
    fn malformed_entries_are_reported_and_skipped() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        let device_of = |ibdev: &str| {
            node.sysfs
                .join("class/infiniband")
                .join(ibdev)
                .join("device")
        };
        // A garbled dev file, a missing verbs dir, a non-numeric NUMA node.
        std::fs::write(
            device_of("rdmap16s27").join("infiniband_verbs/uverbs0/dev"),
            "garbage\n",
        )
        .unwrap();
        std::fs::remove_dir_all(device_of("rdmap32s27").join("infiniband_verbs")).unwrap();
        std::fs::write(device_of("rdmap144s27").join("numa_node"), "zero\n").unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert_eq!(found.devices.len(), 1);
        assert_eq!(found.devices[0].ibdev, "rdmap160s27");
        let reasons: Vec<String> = found.problems.iter().map(ToString::to_string).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(reasons[0].contains("rdmap144s27") && reasons[0].contains("numa_node"));
        assert!(reasons[1].contains("rdmap16s27") && reasons[1].contains("major:minor"));
        assert!(reasons[2].contains("rdmap32s27") && reasons[2].contains("infiniband_verbs"));
    }

    #[test]
    fn only_exact_uverbs_names_count() {
        let (_dir, node, _) = scan_shape(Shape::G5);
        let verbs = node
            .sysfs
            .join("class/infiniband/rdmap0s28/device/infiniband_verbs");
        for decoy in ["uverbs", "uverbs0\n", "uverbs1x", "uverbs-2", "uverbs../x"] {
            std::fs::create_dir(verbs.join(decoy.replace('/', "_"))).unwrap();
        }
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert!(found.problems.is_empty(), "{:?}", found.problems);
        assert_eq!(found.devices[0].uverbs, "uverbs0");
    }

    #[test]
    fn a_device_link_leading_outside_sysfs_is_refused() {
        let (dir, node, _) = scan_shape(Shape::G5);
        let outside = dir.path().join("elsewhere/0000:00:1c.0");
        std::fs::create_dir_all(outside.join("infiniband_verbs/uverbs0")).unwrap();
        std::fs::write(outside.join("infiniband_verbs/uverbs0/dev"), "231:192\n").unwrap();
        let link = node.sysfs.join("class/infiniband/rdmap0s28/device");
        std::fs::remove_file(&link).unwrap();
        // The driver link must still say efa for the entry to be looked at.
        std::os::unix::fs::symlink(
            node.sysfs.join("bus/pci/drivers/efa"),
            outside.join("driver"),
        )
        .unwrap();
        // From <root>/sys/devices/pci0000:00/0000:00:1c.0/infiniband/rdmap0s28 up to <root>.
        std::os::unix::fs::symlink("../../../../../../elsewhere/0000:00:1c.0", &link).unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert!(found.devices.is_empty(), "{:?}", found.devices);
        assert!(
            found.problems[0].reason.contains("outside"),
            "{:?}",
            found.problems
        );
    }

    #[test]
    fn attributes_that_are_not_small_regular_files_are_problems_not_hangs() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        let device = |ibdev: &str| {
            node.sysfs
                .join("class/infiniband")
                .join(ibdev)
                .join("device")
        };
        let fifo = device("rdmap16s27").join("infiniband_verbs/uverbs0/dev");
        std::fs::remove_file(&fifo).unwrap();
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR).unwrap();
        let huge = device("rdmap32s27").join("infiniband_verbs/uverbs1/dev");
        std::fs::File::create(&huge)
            .unwrap()
            .set_len(100 << 20)
            .unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert_eq!(found.devices.len(), 2);
        let reasons: Vec<String> = found.problems.iter().map(ToString::to_string).collect();
        assert!(
            reasons[0].contains("rdmap16s27") && reasons[0].contains("FIFO"),
            "{reasons:?}"
        );
        assert!(
            reasons[1].contains("rdmap32s27") && reasons[1].contains("larger than"),
            "{reasons:?}"
        );
    }

    #[test]
    fn an_unreadable_numa_node_is_reported_and_the_device_kept() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        let numa = node
            .sysfs
            .join("class/infiniband/rdmap16s27/device/numa_node");
        std::fs::remove_file(&numa).unwrap();
        std::fs::create_dir(&numa).unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert_eq!(found.devices.len(), 4);
        assert!(found.problems.is_empty());
        assert_eq!(found.devices[0].numa_node, None);
        let [unreadable] = found.numa_unreadable.as_slice() else {
            panic!("{:?}", found.numa_unreadable);
        };
        assert_eq!(unreadable.entry, "rdmap16s27");
        assert!(unreadable.reason.contains("a directory"), "{unreadable}");
    }

    #[test]
    fn a_failed_listing_is_not_an_empty_node() {
        let (_dir, node, _) = scan_shape(Shape::NoClassDir);
        assert_eq!(
            scan(&node.sysfs, DeviceIdStrategy::Ibdev),
            Scan::default(),
            "absent: no EFA"
        );
        std::fs::write(node.sysfs.join("class"), "").unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        let failed = found.failed.expect("a listing error");
        assert_eq!(failed.code, "ENOTDIR");
        assert!(failed.message.contains("class/infiniband"), "{failed:?}");
    }

    #[test]
    fn an_entry_still_being_read_is_skipped() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        let reads = Reads::default();
        assert!(reads.begin("rdmap32s27"));
        let found = scan_guarded(&node.sysfs, DeviceIdStrategy::Ibdev, &reads);
        assert_eq!(found.devices.len(), 3);
        assert_eq!(found.problems[0].entry, "rdmap32s27");
        assert_eq!(found.problems[0].reason, STILL_READING);
        assert_eq!(
            reads.in_flight().len(),
            1,
            "only the stuck entry stays listed"
        );
    }

    #[test]
    fn folding_keeps_what_a_relative_path_climbs_above() {
        assert_eq!(fold(Path::new("/a/b/../c/./d")), Path::new("/a/c/d"));
        assert_eq!(fold(Path::new("/../a")), Path::new("/a"));
        assert_eq!(fold(Path::new("../../x/sys/../y")), Path::new("../../x/y"));
    }

    #[test]
    fn a_second_entry_for_one_pci_function_is_left_out_and_reported() {
        let (_dir, node, before) = scan_shape(Shape::P4d);
        let class = node.sysfs.join("class/infiniband");
        let target = std::fs::read_link(class.join("rdmap16s27")).unwrap();
        // Sorted before the kernel's entry, so keeping the first by name would keep the twin.
        std::os::unix::fs::symlink(&target, class.join("aaa_twin")).unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert_eq!(found.devices, before.devices, "one device per PCI function");
        let reasons: Vec<String> = found.problems.iter().map(ToString::to_string).collect();
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(
            reasons[0].starts_with("aaa_twin: it names the PCI function 0000:10:1b.0 that the entry rdmap16s27 names already"),
            "{reasons:?}"
        );
    }

    #[test]
    fn a_plain_file_in_the_class_dir_is_ignored() {
        let (_dir, node, _) = scan_shape(Shape::G5);
        std::fs::write(node.sysfs.join("class/infiniband/stray"), "x").unwrap();
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        assert_eq!(found.devices.len(), 1);
        assert!(found.problems.is_empty());
    }

    /// Renames the class entry of `ibdev` to the raw bytes `to`, as `rdma dev set` would.
    fn rename_entry(node: &FakeNode, ibdev: &str, to: &[u8]) {
        use std::os::unix::ffi::OsStrExt;
        let class = node.sysfs.join("class/infiniband");
        std::fs::rename(
            class.join(ibdev),
            class.join(std::ffi::OsStr::from_bytes(to)),
        )
        .unwrap();
    }

    #[test]
    fn names_that_differ_only_in_invalid_utf8_are_both_refused_by_name() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        // Lossily converted, both would read `efa\u{fffd}` and be one ID.
        rename_entry(&node, "rdmap16s27", b"efa\xff");
        rename_entry(&node, "rdmap32s27", b"efa\xfe");
        let found = scan(&node.sysfs, DeviceIdStrategy::Ibdev);
        let ids: Vec<&str> = found.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["rdmap144s27", "rdmap160s27"]);
        let reasons: Vec<String> = found.problems.iter().map(ToString::to_string).collect();
        assert_eq!(reasons.len(), 2, "{reasons:?}");
        assert!(reasons[0].starts_with(r#""efa\xFE": "#), "{reasons:?}");
        assert!(reasons[1].starts_with(r#""efa\xFF": "#), "{reasons:?}");
        assert!(reasons.iter().all(|r| r.contains("not valid UTF-8")));
    }

    #[test]
    fn names_with_a_replica_separator_or_a_control_character_are_refused() {
        let (_dir, node, _) = scan_shape(Shape::P4d);
        assert_eq!(REPLICA_SEPARATOR, crate::allocation::sharing::SEPARATOR);
        rename_entry(&node, "rdmap16s27", b"efa::1");
        rename_entry(&node, "rdmap32s27", b"efa\n2");
        for ids in [DeviceIdStrategy::Ibdev, DeviceIdStrategy::Pci] {
            let found = scan(&node.sysfs, ids);
            assert_eq!(found.devices.len(), 2, "{ids:?}");
            let reasons: Vec<String> = found.problems.iter().map(ToString::to_string).collect();
            assert!(
                reasons[0].starts_with(r#""efa::1": "#) && reasons[0].contains("`::`"),
                "{reasons:?}"
            );
            assert!(
                reasons[1].starts_with(r#""efa\n2": "#) && reasons[1].contains("control"),
                "{reasons:?}"
            );
        }
    }

    #[test]
    fn dev_numbers_parse_strictly() {
        assert_eq!(
            "231:192\n".parse::<DevNum>(),
            Ok(DevNum {
                major: 231,
                minor: 192
            })
        );
        for bad in ["231", "231:", ":1", "a:b", "231:192:1", "-1:3"] {
            assert!(bad.parse::<DevNum>().is_err(), "{bad}");
        }
    }
}
