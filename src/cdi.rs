//! The Container Device Interface spec file, for the `cdi` device-list strategy.
//!
//! Allocate then answers CDI device names (`vpc.amazonaws.com/efa=0000:10:1b.0`); the kubelet
//! hands them to the runtime through CRI, and the runtime looks each name up in the spec files of
//! its CDI dirs and applies the device's edits: here, its uverbs node with the major:minor read
//! from sysfs. The spec carries what [`crate::allocation::contributors`] add: per-device edits in
//! each device's entry, per-container edits (`allocate.env`) in the spec's own edits, which the
//! runtime applies once to any container that gets one of the devices.
//!
//! The module owns the spec file: one file per resource, `<vendor>-<class>.json` in the spec dir,
//! rewritten through [`HostFile`] whenever the devices it describes or the extra device nodes
//! it hands out change.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::allocation::sharing::{self, Sharing};
use crate::allocation::{self, Allocated, Contributors, Delivery, FoundNodes};
use crate::discovery::Efa;
use crate::hostfile::{HostFile, KeepOnExit};
use crate::proto::deviceplugin::{CdiDevice, ContainerAllocateResponse};
use crate::state::{DeviceReader, Holdings, Inventory, Reader};

/// What the spec writer holds per advertised ID at its peak (the start-up budget,
/// `service::budget`, counts it), when a change renders the spec
/// again while the last one is kept: two texts of about 300 bytes per device, their growth
/// slack, and the rendered devices (`benches/memory.rs`: 810 EFAs × 64 in cdi mode peaked at
/// 52.5 MiB, 785 bytes per ID over the device-specs figure, on a quiet host; 613 EFAs × 64
/// peaked at 51.2 MiB on a busy one, where a slow reader keeps more lists and specs alive:
/// 1,043 bytes per ID over the base and the lists).
pub(crate) const PEAK_BYTES_PER_ID: usize = 1050;

/// The spec's kind is the resource name, so several resources of one node never share a file or
/// a device name space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Kind {
    pub vendor: String,
    pub class: String,
}

impl Kind {
    /// The kind for `resource_name`, or why CDI cannot name it: CDI's vendor and class must
    /// start with a letter, end with a letter or digit, and hold only those, `_`, `-` and `.`.
    pub(crate) fn of(resource_name: &str) -> Result<Kind, String> {
        let (vendor, class) = resource_name
            .split_once('/')
            .ok_or_else(|| format!("{resource_name:?} has no '/' to split into a CDI kind"))?;
        for (part, text) in [("vendor", vendor), ("class", class)] {
            let bytes = text.as_bytes();
            let valid = bytes.first().is_some_and(u8::is_ascii_alphabetic)
                && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
            if !valid {
                return Err(format!(
                    "{resource_name:?} is no valid CDI kind: its {part} {text:?} must start with a letter, end with a letter or digit and hold only those, '_', '-' and '.'"
                ));
            }
        }
        Ok(Kind {
            vendor: vendor.to_owned(),
            class: class.to_owned(),
        })
    }

    /// The fully-qualified name the runtime resolves: `vendor/class=name`.
    pub(crate) fn qualified(&self, device: &str) -> String {
        format!("{}/{}={}", self.vendor, self.class, device)
    }

    /// The spec file in `dir`, named as the CDI library names the specs it writes.
    pub(crate) fn spec_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}-{}.json", self.vendor, self.class))
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.vendor, self.class)
    }
}

/// The CDI device name for a kubelet-visible ID: the ID itself, since ibdev names
/// (`rdmap16s27`, `efa_0`), PCI addresses (`0000:10:1b.0`) and replica IDs (`rdmap16s27::3`)
/// are valid CDI names (letters, digits, `_ - . :`, starting and ending with a letter or
/// digit). An ID that is not valid (no kernel names a device so) becomes `id-` and the hex of
/// its bytes: still unique, and never an ibdev name or a PCI address.
pub(crate) fn device_name(id: &str) -> String {
    let bytes = id.as_bytes();
    let valid = bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
    if valid {
        return id.to_owned();
    }
    let mut name = String::from("id-");
    for b in bytes {
        name.push_str(&format!("{b:02x}"));
    }
    name
}

/// The oldest CDI spec version that has every feature a spec uses, so the oldest runtimes can
/// read it. 0.3.0 has device nodes with type, major, minor and permissions, and container env;
/// 0.5.0 first allows device names that start with a digit, as PCI addresses do; 0.6.0 first
/// allows a dot in the class.
fn version(kind: &Kind, devices: &[Device]) -> &'static str {
    if kind.class.contains('.') {
        "0.6.0"
    } else if devices
        .iter()
        .any(|d| d.name.starts_with(|c: char| c.is_ascii_digit()))
    {
        "0.5.0"
    } else {
        "0.3.0"
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    cdi_version: &'static str,
    kind: String,
    devices: Vec<Device>,
    #[serde(skip_serializing_if = "Edits::is_empty")]
    container_edits: Edits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    container_edits: Edits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Edits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<DeviceNode>,
}

impl Edits {
    fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty()
    }
}

impl From<allocation::Edits> for Edits {
    /// Destructured with no `..`, as `allocation::Edits::answer` is, so that a new kind of edit
    /// does not compile until both strategies deliver it.
    fn from(edits: allocation::Edits) -> Self {
        let allocation::Edits { device_nodes, env } = edits;
        Edits {
            env: env
                .iter()
                .map(|(key, value)| format!("{key}={value}"))
                .collect(),
            device_nodes: device_nodes
                .into_iter()
                .map(
                    |allocation::DeviceNode {
                         container_path,
                         host_path: _,
                         dev,
                         permissions,
                     }| DeviceNode {
                        path: container_path,
                        kind: "c",
                        major: dev.major,
                        minor: dev.minor,
                        permissions,
                    },
                )
                .collect(),
        }
    }
}

/// The host path is left out: CDI takes the node from `major:minor` at `path`.
#[derive(Serialize)]
struct DeviceNode {
    path: String,
    #[serde(rename = "type")]
    kind: &'static str,
    major: u32,
    minor: u32,
    permissions: &'static str,
}

/// What the spec says: its kind, the IDs it names each device by, and what the devices bring.
#[derive(Clone)]
pub(crate) struct SpecSettings {
    pub kind: Kind,
    pub sharing: Sharing,
    pub contributors: Contributors,
}

/// The spec for `inventory`: every device the kubelet is told about, healthy or not (a container
/// that holds a device that turned unhealthy may still be restarted), once per advertised ID,
/// each with its uverbs node at the path libibverbs expects; and once per foreign ID that a pod
/// holds (`holdings`), with the edits of the EFA it names. The kubelet restarts a container with
/// the CDI names it was first given, so after a switch of ID strategy or sharing count a
/// restarted container needs its old names resolved: they stay for as long as the PodResources
/// view shows them held, which costs nothing on a node that never switched, where listing every
/// EFA's other names always would double the largest spec. `None` without devices: CDI counts
/// a spec with no device as an error, which runtimes would report for every container.
///
/// `kept` are the IDs the spec on disk named when the plugin started: until the PodResources
/// view has answered once, a held foreign ID is only known from there, and dropped from the spec
/// a container restarted meanwhile could not resolve its CDI name.
pub(crate) fn render(
    inventory: &Inventory,
    settings: &SpecSettings,
    holdings: &Holdings,
    kept: &KeptIds,
) -> Option<String> {
    let device = |name: &str, efa| Device {
        name: device_name(name),
        container_edits: settings.contributors.device_edits(efa).into(),
    };
    let mut devices: Vec<Device> = inventory
        .devices()
        .flat_map(|record| {
            let efa = &record.efa;
            settings
                .sharing
                .advertised(&efa.id)
                .map(move |id| device(&id, efa))
        })
        .collect();
    let names = inventory.by_name();
    // Never answered: neither known nor kept over failed polls.
    let never_answered = !holdings.known && !holdings.stale;
    let kept = kept.0.iter().filter(|_| never_answered).filter(|id| {
        settings
            .sharing
            .parse(id)
            .is_none_or(|(device, _)| inventory.get(device).is_none())
    });
    let foreign: BTreeMap<&str, &Efa> = holdings
        .foreign
        .iter()
        .flat_map(|hold| &hold.ids)
        .chain(kept)
        .filter_map(|id| {
            let record = names.get(sharing::device_of(id))?;
            Some((id.as_str(), &record.efa))
        })
        .collect();
    devices.extend(foreign.into_iter().map(|(id, efa)| device(id, efa)));
    if devices.is_empty() {
        return None;
    }
    let spec = Spec {
        cdi_version: version(&settings.kind, &devices),
        kind: settings.kind.to_string(),
        devices,
        container_edits: settings.contributors.container_edits().into(),
    };
    let mut text = serde_json::to_string_pretty(&spec).ok()?;
    text.push('\n');
    Some(text)
}

/// The spec's permission bits: world-readable, as CDI specs under /etc/cdi and /var/run/cdi
/// conventionally are. containerd and CRI-O read it as root, but CDI readers that run
/// unprivileged (rootless podman, listing tools) read the same dirs, and the spec holds nothing
/// secret: device node paths, and `allocate.env`, which the plugin's config already shows.
const SPEC_MODE: u32 = 0o644;

/// What the spec is rendered from: the device snapshot, the PodResources view for the
/// foreign IDs pods hold, and the extra device nodes the contributors hand out (the same
/// look-up's), so a node that appears after the start reaches the spec without waiting for an
/// unrelated device change.
pub(crate) struct Sources {
    pub state: DeviceReader,
    pub holdings: Reader<Arc<Holdings>>,
    pub extra: FoundNodes,
}

/// Keeps the spec file in `dir` current until `shutdown`, then removes it; failed writes are
/// retried, and the file on disk compared with the spec, every `recheck`; failures are counted
/// in `failures`.
pub(crate) async fn run(
    dir: PathBuf,
    settings: SpecSettings,
    recheck: Duration,
    failures: Counter,
    Sources {
        state,
        holdings,
        extra,
    }: Sources,
    keep_on_exit: KeepOnExit,
    shutdown: CancellationToken,
) {
    let path = settings.kind.spec_path(&dir);
    let kept = KeptIds::read(&path);
    let file = HostFile {
        path,
        what: "CDI spec",
        recheck,
        mode: SPEC_MODE,
        failures: Some(failures),
        keep_on_exit: Some(keep_on_exit),
        holdings: Some(holdings),
        also: Some(Box::pin(extra.changes())),
    };
    file.follow(
        state,
        |inventory, holdings| render(inventory, &settings, holdings, &kept),
        shutdown,
    )
    .await
}

/// The IDs a spec file names, read when the plugin starts: the spec an earlier run kept on exit,
/// while pods held EFAs by its names.
#[derive(Debug, Default)]
pub(crate) struct KeptIds(BTreeSet<String>);

/// The largest kept spec read: above the spec of the largest sharing start-up accepts.
const KEPT_SPEC_LIMIT: u64 = 64 << 20;

impl KeptIds {
    /// The IDs of the spec at `path`; none if there is none, or it cannot be read (which is
    /// logged: its held names are then unknown until the kubelet's PodResources answers).
    pub(crate) fn read(path: &Path) -> KeptIds {
        #[derive(Deserialize)]
        struct Named {
            devices: Vec<Name>,
        }
        #[derive(Deserialize)]
        struct Name {
            name: String,
        }
        let text = match crate::fsread::read_text(path, KEPT_SPEC_LIMIT) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return KeptIds::default(),
            Err(err) => return KeptIds::unreadable(path, &err.to_string()),
        };
        match serde_json::from_str::<Named>(&text) {
            Ok(named) => KeptIds(
                named
                    .devices
                    .into_iter()
                    .map(|device| id_of_name(&device.name))
                    .collect(),
            ),
            Err(err) => KeptIds::unreadable(path, &err.to_string()),
        }
    }

    fn unreadable(path: &Path, error: &str) -> KeptIds {
        tracing::warn!(
            file = %path.display(),
            %error,
            "cannot read the CDI spec kept by an earlier run; the IDs pods hold by its names are known again once the kubelet's PodResources answers"
        );
        KeptIds::default()
    }
}

/// The ID a spec's device name stands for: [`device_name`] undone.
fn id_of_name(name: &str) -> String {
    let decoded = name
        .strip_prefix("id-")
        .filter(|hex| hex.len() % 2 == 0)
        .and_then(|hex| {
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()
        })
        .and_then(|bytes| String::from_utf8(bytes).ok());
    match decoded {
        // A valid ID that merely starts with `id-` is its own name.
        Some(id) if device_name(&id) == name => id,
        _ => name.to_owned(),
    }
}

/// Why the spec must outlive the plugin, if it must. The kubelet restarts a container of a
/// running pod from its checkpoint, without calling the plugin, and the runtime then resolves
/// the container's CDI names from this file: removed during a rollout or a crash loop, every
/// EFA container that restarts would fail to start.
pub(crate) fn still_needed(holdings: &Holdings) -> Option<String> {
    if !holdings.known {
        return Some(
            "the kubelet's PodResources could not be read, so containers may still need it".into(),
        );
    }
    let holders: usize = holdings.holders.values().map(Vec::len).sum();
    (holders > 0).then(|| format!("{holders} container(s) hold EFAs and may restart"))
}

/// The cdi strategy's answer: each allocated EFA by its CDI name, for the runtime to take the
/// EFA's edits from the spec. The per-container environment goes into the answer too, so the
/// kubelet's checkpoint records it as it does with device-specs.
pub(crate) struct CdiNames {
    pub kind: Kind,
}

impl Delivery for CdiNames {
    fn answer(&self, devices: &[Allocated], from: &Contributors) -> ContainerAllocateResponse {
        let cdi_devices = devices
            .iter()
            .map(|device| CdiDevice {
                name: self.kind.qualified(&device_name(device.id)),
            })
            .collect();
        ContainerAllocateResponse {
            cdi_devices,
            envs: from.container_edits().env.into_iter().collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_kept_specs_names_read_back_as_the_ids_they_name() {
        for id in [
            "rdmap16s27",
            "0000:10:1b.0::3",
            "efa_0",
            "id-41",
            "-odd-",
            "é",
            "",
        ] {
            assert_eq!(id_of_name(&device_name(id)), id, "{id:?}");
        }
    }

    use super::*;
    use crate::allocation::{Allocator, Contributor, DeviceSpecs};
    use crate::discovery::{DeviceIdStrategy, Efa};
    use crate::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    use crate::testkit::simulate::{self, Shape, inventory};
    use std::num::NonZeroU32;

    fn settings(replicas: u32, env: &[(&str, &str)]) -> SpecSettings {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SpecSettings {
            kind: Kind::of("vpc.amazonaws.com/efa").unwrap(),
            sharing: Sharing::replicas(NonZeroU32::new(replicas).unwrap()),
            contributors: allocation::contributors(
                Path::new("/dev"),
                &env,
                allocation::FoundNodes::none(),
            ),
        }
    }

    fn parse(text: &Option<String>) -> serde_json::Value {
        serde_json::from_str(text.as_deref().expect("a spec")).unwrap()
    }

    #[test]
    fn kubelet_ids_are_their_own_cdi_names() {
        assert_eq!(device_name("0000:10:1b.0"), "0000:10:1b.0");
        assert_eq!(device_name("0000:10:1b.0::3"), "0000:10:1b.0::3");
        assert_eq!(device_name("a/b"), "id-612f62");
        assert_eq!(device_name("x:"), "id-783a");
        assert_eq!(device_name(""), "id-");
    }

    #[test]
    fn kinds_follow_the_cdi_rules() {
        let kind = Kind::of("vpc.amazonaws.com/efa").unwrap();
        assert_eq!(
            kind.qualified("0000:10:1b.0"),
            "vpc.amazonaws.com/efa=0000:10:1b.0"
        );
        assert_eq!(
            kind.spec_path(Path::new("/var/run/cdi")),
            Path::new("/var/run/cdi/vpc.amazonaws.com-efa.json")
        );
        for bad in ["9example.com/efa", "example.com/_efa", "example.com/efa-"] {
            assert!(Kind::of(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn p4d_spec_lists_each_node_with_its_sysfs_numbers() {
        let spec = parse(&render(
            &inventory(Shape::P4d),
            &settings(1, &[]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        // ibdev names start with a letter, so the oldest runtimes can read the spec.
        assert_eq!(spec["cdiVersion"], "0.3.0");
        assert_eq!(spec["kind"], "vpc.amazonaws.com/efa");
        assert!(spec.get("containerEdits").is_none());
        let devices = spec["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 4);
        let names: Vec<&str> = devices
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["rdmap144s27", "rdmap160s27", "rdmap16s27", "rdmap32s27"]
        );
        assert_eq!(
            devices[2]["containerEdits"]["deviceNodes"],
            serde_json::json!([{
                "path": "/dev/infiniband/uverbs0",
                "type": "c",
                "major": 231,
                "minor": 192,
                "permissions": "rw"
            }])
        );
    }

    #[test]
    fn dynamic_majors_come_from_sysfs() {
        let spec = parse(&render(
            &inventory(Shape::Dense256),
            &settings(1, &[]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        let devices = spec["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 256);
        let majors: std::collections::BTreeSet<u64> = devices
            .iter()
            .map(|d| {
                d["containerEdits"]["deviceNodes"][0]["major"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(majors.into_iter().collect::<Vec<_>>(), [231, 511]);
    }

    #[test]
    fn sharing_lists_every_replica_and_env_is_spec_wide() {
        let spec = parse(&render(
            &inventory(Shape::P4d),
            &settings(3, &[("FI_PROVIDER", "efa"), ("A", "x=y,z")]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        let names: Vec<&str> = spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.len(), 12);
        assert_eq!(
            &names[..3],
            ["rdmap144s27::0", "rdmap144s27::1", "rdmap144s27::2"]
        );
        assert_eq!(
            spec["containerEdits"],
            serde_json::json!({"env": ["A=x=y,z", "FI_PROVIDER=efa"]})
        );
    }

    #[test]
    fn version_is_the_oldest_with_the_features_used() {
        assert_eq!(
            render(
                &Inventory::default(),
                &settings(1, &[]),
                &Holdings::default(),
                &KeptIds::default()
            ),
            None
        );
        let mut odd = inventory(Shape::G5).devices().next().unwrap().clone();
        odd.efa.id = "pci/0".into();
        let odd = Inventory::default().observe(vec![odd]).0;
        let spec = parse(&render(
            &odd,
            &settings(1, &[]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        assert_eq!(spec["devices"][0]["name"], "id-7063692f30");
        assert_eq!(spec["cdiVersion"], "0.3.0");
        let by_pci = simulate::inventory_named(Shape::P4d, DeviceIdStrategy::Pci);
        let spec = parse(&render(
            &by_pci,
            &settings(1, &[]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        assert_eq!(spec["devices"][0]["name"], "0000:10:1b.0");
        assert_eq!(spec["cdiVersion"], "0.5.0", "a name starts with a digit");
        let dotted = SpecSettings {
            kind: Kind::of("example.com/efa.shared").unwrap(),
            ..settings(1, &[])
        };
        assert_eq!(
            parse(&render(
                &inventory(Shape::P4d),
                &dotted,
                &Holdings::default(),
                &KeptIds::default()
            ))["cdiVersion"],
            "0.6.0"
        );
    }

    /// The device nodes the spec gives the container that asks for `name`.
    fn nodes_of<'a>(spec: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
        let devices = spec["devices"].as_array().unwrap();
        let device = devices.iter().find(|d| d["name"] == name);
        &device.unwrap_or_else(|| panic!("{name} in the spec"))["containerEdits"]["deviceNodes"]
    }

    #[test]
    fn after_a_switch_the_names_pods_hold_resolve_to_the_same_nodes_while_held() {
        use crate::holdings::derive;
        use crate::proto::podresources::ListPodResourcesResponse;
        use crate::testkit::pod_resources_stub::pod;
        const EFA: &str = "vpc.amazonaws.com/efa";
        // The node ran ibdev IDs, the second pod's EFA shared 2 ways; it now runs PCI IDs.
        let by_pci = simulate::inventory_named(Shape::P4d, DeviceIdStrategy::Pci);
        let response = ListPodResourcesResponse {
            pod_resources: vec![
                pod("ml", "trainer-0", "main", EFA, &["rdmap16s27"]),
                pod("ml", "trainer-0", "side", EFA, &["rdmap16s27"]),
                pod("ml", "trainer-1", "main", EFA, &["rdmap32s27::1", "efa_9"]),
            ],
        };
        let holdings = derive(&response, EFA, &by_pci, Sharing::default());
        let spec = parse(&render(
            &by_pci,
            &settings(1, &[]),
            &holdings,
            &KeptIds::default(),
        ));
        assert_eq!(
            spec_names(&spec),
            [
                "0000:10:1b.0",
                "0000:20:1b.0",
                "0000:90:1b.0",
                "0000:a0:1b.0",
                "rdmap16s27",
                "rdmap32s27::1"
            ],
            "each held name once; `efa_9` names no EFA here"
        );
        assert_eq!(
            nodes_of(&spec, "rdmap16s27"),
            nodes_of(&spec, "0000:10:1b.0")
        );
        assert_eq!(
            nodes_of(&spec, "rdmap32s27::1"),
            nodes_of(&spec, "0000:20:1b.0")
        );
        assert_eq!(
            nodes_of(&spec, "rdmap16s27")[0]["path"],
            "/dev/infiniband/uverbs0"
        );
        // Once no pod holds them, the old names go.
        let spec = parse(&render(
            &by_pci,
            &settings(1, &[]),
            &Holdings::default(),
            &KeptIds::default(),
        ));
        assert_eq!(spec_names(&spec).len(), 4);
    }

    fn spec_names(spec: &serde_json::Value) -> Vec<&str> {
        spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect()
    }

    /// A contributor says what it adds per EFA and per container, and nothing of strategies;
    /// the one list of them (`allocation::contributors` in the plugin) feeds the device-specs
    /// answer, the cdi answer and the CDI spec alike.
    struct Marker;

    impl Contributor for Marker {
        fn device_edits(&self, efa: &Efa, edits: &mut allocation::Edits) {
            edits
                .env
                .insert(format!("MARK_{}", efa.uverbs), efa.id.clone());
        }

        fn container_edits(&self, edits: &mut allocation::Edits) {
            edits.env.insert("MARKED".into(), "yes".into());
        }
    }

    #[test]
    fn a_new_contributor_reaches_both_strategies() {
        let contributors = Contributors::new(vec![Box::new(Marker)]);
        let kind = Kind::of("vpc.amazonaws.com/efa").unwrap();
        let inventory = inventory(Shape::P4d);
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["rdmap16s27".into()],
            }],
        };
        let answer = |delivery: Box<dyn Delivery>| {
            Allocator::new(delivery, contributors.clone())
                .allocate(&inventory, &request)
                .unwrap()
                .container_responses
                .remove(0)
        };

        let device_specs = answer(Box::new(DeviceSpecs));
        assert_eq!(device_specs.envs["MARK_uverbs0"], "rdmap16s27");
        assert_eq!(device_specs.envs["MARKED"], "yes");

        let cdi = answer(Box::new(CdiNames { kind: kind.clone() }));
        assert_eq!(cdi.cdi_devices[0].name, "vpc.amazonaws.com/efa=rdmap16s27");
        assert_eq!(
            cdi.envs.len(),
            1,
            "the EFA's own edits are the spec's: {cdi:?}"
        );
        assert_eq!(cdi.envs["MARKED"], "yes");
        let settings = SpecSettings {
            kind,
            sharing: Sharing::default(),
            contributors,
        };
        let spec = parse(&render(
            &inventory,
            &settings,
            &Holdings::default(),
            &KeptIds::default(),
        ));
        assert_eq!(
            spec["containerEdits"],
            serde_json::json!({"env": ["MARKED=yes"]})
        );
        let device = spec["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == "rdmap16s27")
            .unwrap();
        assert_eq!(
            device["containerEdits"],
            serde_json::json!({"env": ["MARK_uverbs0=rdmap16s27"]})
        );
    }
}
