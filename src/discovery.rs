//! Finds the node's EFA devices in sysfs.
//!
//! An EFA is an entry of `<sysfs>/class/infiniband` whose PCI function is bound to the `efa`
//! driver; every other RDMA device (mlx5 `ibp*` on p6-b200, for one) is ignored. Nothing here is
//! derived from `/sys/class/net`: EFA-only interfaces have no netdev.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The kernel driver name that marks an RDMA device as an EFA.
pub const EFA_DRIVER: &str = "efa";

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

/// One EFA as sysfs describes it at the time of a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Efa {
    /// PCI address (`0000:10:1b.0`): stable across restarts, reboots and ibdev renames.
    pub id: String,
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
    /// Sorted by id.
    pub devices: Vec<Efa>,
    pub problems: Vec<Problem>,
}

/// Reads every EFA below `sysfs_root`. A missing class directory means no EFA, not an error:
/// the driver may load after the plugin starts.
pub fn scan(sysfs_root: &Path) -> Scan {
    let class = sysfs_root.join("class/infiniband");
    let mut result = Scan::default();
    let entries = match fs::read_dir(&class) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return result,
        Err(err) => {
            result.problems.push(Problem {
                entry: class.display().to_string(),
                reason: err.to_string(),
            });
            return result;
        }
    };
    for entry in entries.flatten() {
        let ibdev = entry.file_name().to_string_lossy().into_owned();
        let dir = entry.path();
        match driver_of(&dir) {
            Some(driver) if driver == EFA_DRIVER => {}
            _ => continue,
        }
        match read_efa(sysfs_root, &dir, &ibdev) {
            Ok(efa) => result.devices.push(efa),
            Err(reason) => result.problems.push(Problem {
                entry: ibdev,
                reason,
            }),
        }
    }
    result.devices.sort_by(|a, b| a.id.cmp(&b.id));
    result.problems.sort_by(|a, b| a.entry.cmp(&b.entry));
    result
}

/// Basename of `<ibdev>/device/driver`, the kernel's own statement of which driver owns the device.
fn driver_of(ibdev_dir: &Path) -> Option<String> {
    let target = fs::read_link(ibdev_dir.join("device/driver")).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

fn read_efa(sysfs_root: &Path, ibdev_dir: &Path, ibdev: &str) -> Result<Efa, String> {
    let function = ibdev_dir.join("device");
    let id = fs::read_link(&function)
        .map_err(|err| format!("device link: {err}"))?
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .ok_or("device link has no file name")?;
    let uverbs = uverbs_of(&function)?;
    let dev = read_trimmed(&function.join("infiniband_verbs").join(&uverbs).join("dev"))?
        .parse::<DevNum>()
        .map_err(|err| format!("{uverbs}/dev: {err}"))?;
    let numa_node = match read_trimmed(&function.join("numa_node")) {
        Ok(text) => parse_numa(&text)?,
        Err(_) => None,
    };
    Ok(Efa {
        pci_path: pci_path(sysfs_root, &function)?,
        id,
        ibdev: ibdev.to_owned(),
        uverbs,
        dev,
        numa_node,
        vendor: read_trimmed(&function.join("vendor")).unwrap_or_default(),
        device: read_trimmed(&function.join("device")).unwrap_or_default(),
    })
}

fn uverbs_of(function: &Path) -> Result<String, String> {
    let dir = function.join("infiniband_verbs");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .map_err(|err| format!("infiniband_verbs: {err}"))?
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("uverbs"))
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

fn parse_numa(text: &str) -> Result<Option<u32>, String> {
    let node: i64 = text
        .parse()
        .map_err(|_| format!("numa_node: not a number: {text:?}"))?;
    Ok(u32::try_from(node).ok())
}

fn pci_path(sysfs_root: &Path, function: &Path) -> Result<String, String> {
    let real = fs::canonicalize(function).map_err(|err| format!("device link: {err}"))?;
    let devices = fs::canonicalize(sysfs_root.join("devices")).unwrap_or_else(|_| PathBuf::new());
    let below = real.strip_prefix(&devices).unwrap_or(&real);
    Ok(below.to_string_lossy().trim_start_matches('/').to_owned())
}

fn read_trimmed(path: &Path) -> Result<String, String> {
    fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .map_err(|err| format!("{}: {err}", path.display()))
}
