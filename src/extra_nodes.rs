//! Host device nodes every container with EFAs gets besides its uverbs nodes
//! (`--extra-device-nodes`), such as GDRCopy's `/dev/gdrdrv`, which GPU-initiated networking
//! (NCCL GIN, EFA-GDA) opens next to the EFAs. Without it a pod needs `privileged: true`.
//!
//! Each node is looked up below the dev root at start and at every rescan, with the
//! `major:minor` the host gives it now: gdrdrv's major is dynamic, so a module reload may change
//! it, and its install may come after the plugin's start. Allocate only reads the last result
//! (`allocation::FoundNodes`); a change of it has the CDI spec rendered again. A node that is
//! missing or not a character device is left out and logged, never fatal: a node without
//! GDRCopy still serves its EFAs.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::allocation::{DeviceNode, FoundNodes};
use crate::discovery::DevNum;
use crate::rescan::Rescans;

/// What one look-up found for each configured node: the node, or why it is left out.
type Outcome = BTreeMap<String, Result<DeviceNode, String>>;

/// Keeps the found nodes current for the contributor that hands them out.
pub(crate) struct Lookup {
    /// Each node as containers name it, with its path on the host.
    nodes: Vec<(String, PathBuf)>,
    found: watch::Sender<Arc<[DeviceNode]>>,
    last: Outcome,
}

impl Lookup {
    /// Looks the nodes up once, logging what it finds, and returns the look-up and what the
    /// contributor reads.
    pub(crate) fn start(nodes: Vec<(String, PathBuf)>) -> (Lookup, FoundNodes) {
        let (found, reader) = watch::channel(Arc::from([]));
        let mut lookup = Lookup {
            nodes,
            found,
            last: Outcome::new(),
        };
        lookup.apply(look_up_all(&lookup.nodes));
        (lookup, FoundNodes::new(reader))
    }

    /// Looks again every `interval` until shutdown. The look-up runs on the blocking pool, as
    /// every filesystem pass does, so a slow one cannot stall the RPCs on the runtime thread.
    pub(crate) async fn run(mut self, interval: Duration, shutdown: CancellationToken) {
        let mut rescans = Rescans::every(interval, shutdown);
        while rescans.due().await {
            let nodes = self.nodes.clone();
            match tokio::task::spawn_blocking(move || look_up_all(&nodes)).await {
                Ok(outcome) => self.apply(outcome),
                // The last result stands until a later pass gets through.
                Err(err) => {
                    tracing::error!(error = %err, "looking up the extra device nodes failed")
                }
            }
        }
    }

    /// Publishes `outcome` and logs each node whose outcome changed: once when it is found or
    /// its number changes, once when it goes missing.
    fn apply(&mut self, outcome: Outcome) {
        for (node, now) in &outcome {
            if self.last.get(node) == Some(now) {
                continue;
            }
            match now {
                Ok(found) => tracing::info!(
                    node = %node,
                    host_path = %found.host_path.display(),
                    dev = %found.dev,
                    "every container with EFAs gets this extra device node"
                ),
                Err(reason) => tracing::warn!(
                    node = %node,
                    reason = %reason,
                    "extra device node left out of containers until it appears"
                ),
            }
        }
        let found: Arc<[DeviceNode]> = outcome.values().flatten().cloned().collect();
        self.found.send_if_modified(|current| {
            let changed = *current != found;
            if changed {
                *current = found;
            }
            changed
        });
        self.last = outcome;
    }
}

fn look_up_all(nodes: &[(String, PathBuf)]) -> Outcome {
    nodes
        .iter()
        .map(|(node, host_path)| (node.clone(), look_up(node, host_path)))
        .collect()
}

/// The node containers name `node`, at `host_path`, if it is a character device; its number is
/// the host's, which the CDI spec needs and the runtime checks a DeviceSpec's path against.
fn look_up(node: &str, host_path: &Path) -> Result<DeviceNode, String> {
    let meta = std::fs::metadata(host_path).map_err(|err| match err.kind() {
        io::ErrorKind::NotFound => format!("{} is missing", host_path.display()),
        _ => format!("{}: {err}", host_path.display()),
    })?;
    if !meta.file_type().is_char_device() {
        return Err(format!(
            "{} is {}, not a character device",
            host_path.display(),
            crate::fsread::describe(meta.file_type())
        ));
    }
    let rdev = meta.rdev();
    Ok(DeviceNode {
        container_path: node.to_owned(),
        host_path: host_path.to_owned(),
        dev: DevNum {
            major: nix::sys::stat::major(rdev) as u32,
            minor: nix::sys::stat::minor(rdev) as u32,
        },
        permissions: "rw",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::{self, Allocator, Delivery, DeviceSpecs};
    use crate::cdi::{self, CdiNames, Kind, SpecSettings};
    use crate::config::device_node_under;
    use crate::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    use crate::testkit::simulate::{Shape, inventory, make_char_device};

    const GDRDRV: DevNum = DevNum {
        major: 235,
        minor: 0,
    };

    /// A test dev root's `gdrdrv`: a real character node where the test may create one, else
    /// a link to the host's `/dev/null`, which a look-up follows to a character device too.
    fn fake_gdrdrv(dev_root: &Path) -> DevNum {
        let path = dev_root.join("gdrdrv");
        if make_char_device(&path, GDRDRV).is_ok() {
            return GDRDRV;
        }
        std::os::unix::fs::symlink("/dev/null", &path).unwrap();
        let rdev = std::fs::metadata(&path).unwrap().rdev();
        DevNum {
            major: nix::sys::stat::major(rdev) as u32,
            minor: nix::sys::stat::minor(rdev) as u32,
        }
    }

    fn nodes(dev_root: &Path, names: &[&str]) -> Vec<(String, PathBuf)> {
        names
            .iter()
            .map(|n| (n.to_string(), device_node_under(dev_root, n)))
            .collect()
    }

    fn answer(contributors: &allocation::Contributors, delivery: Box<dyn Delivery>) -> Vec<String> {
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["rdmap16s27".into(), "rdmap32s27".into()],
            }],
        };
        let response = Allocator::new(delivery, contributors.clone())
            .allocate(&inventory(Shape::P4d), &request)
            .unwrap()
            .container_responses
            .remove(0);
        response
            .devices
            .iter()
            .map(|d| format!("{} {} {}", d.container_path, d.host_path, d.permissions))
            .collect()
    }

    #[test]
    fn a_fake_gdrdrv_reaches_device_specs_and_the_cdi_spec_once_per_container() {
        let dev = tempfile::tempdir().unwrap();
        let number = fake_gdrdrv(dev.path());
        let (_lookup, found) = Lookup::start(nodes(dev.path(), &["/dev/gdrdrv", "/dev/absent"]));
        let contributors = allocation::contributors(dev.path(), &BTreeMap::new(), found);

        let specs = answer(&contributors, Box::new(DeviceSpecs));
        let gdrdrv = format!("/dev/gdrdrv {} rw", dev.path().join("gdrdrv").display());
        assert_eq!(
            specs.iter().filter(|s| **s == gdrdrv).count(),
            1,
            "once, beside the two uverbs nodes: {specs:?}"
        );
        assert_eq!(specs.len(), 3, "the missing node is left out: {specs:?}");

        let kind = Kind::of("vpc.amazonaws.com/efa").unwrap();
        let settings = SpecSettings {
            kind: kind.clone(),
            sharing: Default::default(),
            contributors: contributors.clone(),
        };
        let spec: serde_json::Value = serde_json::from_str(
            &cdi::render(&inventory(Shape::P4d), &settings, &Default::default()).unwrap(),
        )
        .unwrap();
        assert_eq!(
            spec["containerEdits"]["deviceNodes"],
            serde_json::json!([{
                "path": "/dev/gdrdrv",
                "type": "c",
                "major": number.major,
                "minor": number.minor,
                "permissions": "rw",
            }]),
            "{spec:#}"
        );
        // The cdi answer names the EFAs only; their nodes and gdrdrv come from the spec.
        assert!(answer(&contributors, Box::new(CdiNames { kind })).is_empty());
    }

    #[tokio::test]
    async fn a_node_that_appears_changes_or_goes_is_picked_up_at_the_next_rescan() {
        let dev = tempfile::tempdir().unwrap();
        let (mut lookup, found) = Lookup::start(nodes(dev.path(), &["/dev/gdrdrv"]));
        let contributors = allocation::contributors(dev.path(), &BTreeMap::new(), found);
        let extra = || contributors.container_edits().device_nodes;
        assert!(extra().is_empty(), "missing at start: left out, not fatal");

        let number = fake_gdrdrv(dev.path());
        lookup.apply(look_up_all(&lookup.nodes));
        assert_eq!(extra().len(), 1);
        assert_eq!(extra()[0].dev, number);

        std::fs::remove_file(dev.path().join("gdrdrv")).unwrap();
        std::fs::create_dir(dev.path().join("gdrdrv")).unwrap();
        lookup.apply(look_up_all(&lookup.nodes));
        assert!(
            extra().is_empty(),
            "a directory is not handed to containers"
        );
    }

    /// The spec file's extra nodes as `path major:minor`, once it exists.
    fn spec_extra(path: &Path) -> Option<Vec<String>> {
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
        let nodes = spec["containerEdits"]["deviceNodes"].as_array();
        Some(
            nodes
                .into_iter()
                .flatten()
                .map(|n| {
                    format!(
                        "{} {}:{}",
                        n["path"].as_str().unwrap(),
                        n["major"],
                        n["minor"]
                    )
                })
                .collect(),
        )
    }

    async fn wait_for_spec(path: &Path, want: &[String]) {
        for _ in 0..500 {
            if spec_extra(path).as_deref() == Some(want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "the spec's extra nodes stayed {:?}, not {want:?}",
            spec_extra(path)
        );
    }

    /// A gdrdrv loaded after the plugin started (after a reboot, the module often comes later)
    /// must reach the spec at the look-up that finds it: with no device change, the spec would
    /// lack it until the next restart, and every GIN container would abort.
    #[tokio::test]
    async fn the_cdi_spec_follows_a_node_that_appears_or_goes_after_the_start() {
        let dev = tempfile::tempdir().unwrap();
        let cdi_dir = tempfile::tempdir().unwrap();
        let (mut lookup, found) = Lookup::start(nodes(dev.path(), &["/dev/gdrdrv"]));
        let kind = Kind::of("vpc.amazonaws.com/efa").unwrap();
        let path = kind.spec_path(cdi_dir.path());
        let state = crate::state::DeviceState::default();
        state.apply(inventory(Shape::P4d).devices().cloned().collect());
        let shutdown = CancellationToken::new();
        let writer = tokio::spawn(cdi::run(
            cdi_dir.path().to_owned(),
            SpecSettings {
                kind,
                sharing: Default::default(),
                contributors: allocation::contributors(dev.path(), &BTreeMap::new(), found.clone()),
            },
            // Longer than the test: only the look-up's change can rewrite the spec.
            Duration::from_secs(3600),
            Default::default(),
            cdi::Sources {
                state: state.reader(),
                holdings: watch::channel(Default::default()).1,
                extra: found,
            },
            Box::new(|| Box::pin(async { None })),
            shutdown.clone(),
        ));
        wait_for_spec(&path, &[]).await;

        let number = fake_gdrdrv(dev.path());
        lookup.apply(look_up_all(&lookup.nodes));
        wait_for_spec(&path, &[format!("/dev/gdrdrv {number}")]).await;

        std::fs::remove_file(dev.path().join("gdrdrv")).unwrap();
        lookup.apply(look_up_all(&lookup.nodes));
        wait_for_spec(&path, &[]).await;

        shutdown.cancel();
        writer.await.unwrap();
    }

    #[test]
    fn a_look_up_names_why_a_node_is_left_out() {
        let dev = tempfile::tempdir().unwrap();
        std::fs::write(dev.path().join("gdrdrv"), "").unwrap();
        let missing = look_up(
            "/dev/nvidia-gdr",
            &device_node_under(dev.path(), "/dev/nvidia-gdr"),
        )
        .unwrap_err();
        assert!(missing.ends_with("nvidia-gdr is missing"), "{missing}");
        let regular =
            look_up("/dev/gdrdrv", &device_node_under(dev.path(), "/dev/gdrdrv")).unwrap_err();
        assert!(regular.contains("not a character device"), "{regular}");
    }
}
