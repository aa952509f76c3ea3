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
//!
//! A node is judged by what it is, not by its name: the runtime follows links, so udev's
//! `/dev/char/231:192`, a link to `infiniband/uverbs0`, would give EFA 0 to every container
//! with EFAs. A node that resolves into `<dev-root>/infiniband` or out of the dev root, or has
//! an EFA's uverbs `major:minor`, is refused: at start that is a configuration error; later it
//! is withheld, and logged, while it lasts.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::allocation::DeviceNode;
use crate::discovery::DevNum;
use crate::rescan::Rescans;
use crate::state::{DeviceReader, Inventory, Writer};

/// What one look-up found for each configured node: the node, or why it is left out.
type Outcome = BTreeMap<String, Result<DeviceNode, LeftOut>>;

/// Why a configured node is not handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LeftOut {
    /// Missing, or not a character device: it may appear later, as gdrdrv does once its
    /// module loads.
    Absent(String),
    /// An EFA's node under another name, or a node outside the dev tree: every container
    /// with EFAs would get it.
    Refused(String),
}

/// Each EFA's uverbs `major:minor`, with its name for the log.
type EfaNumbers = BTreeMap<DevNum, String>;

/// Keeps the found nodes current for the contributor that hands them out.
pub(crate) struct Lookup {
    /// Each node as containers name it, with its path on the host.
    nodes: Vec<(String, PathBuf)>,
    dev_root: PathBuf,
    /// The EFAs a node must not be.
    efas: DeviceReader,
    /// What the contributor reads: empty until [`Lookup::start`].
    found: Writer<Arc<[DeviceNode]>>,
    last: Outcome,
}

impl Lookup {
    /// The look-up of `nodes` below `dev_root`, judged against the EFAs in `efas`, which
    /// writes what it finds to `found`.
    pub(crate) fn new(
        nodes: Vec<(String, PathBuf)>,
        dev_root: PathBuf,
        efas: DeviceReader,
        found: Writer<Arc<[DeviceNode]>>,
    ) -> Lookup {
        Lookup {
            nodes,
            dev_root,
            efas,
            found,
            last: Outcome::new(),
        }
    }

    /// Looks the nodes up once, once the first scan has found the EFAs, and logs what it finds.
    /// A node refused now was configured wrong: the error names it and why, and nothing is
    /// handed out.
    pub(crate) fn start(&mut self) -> Result<(), String> {
        let outcome = self.look_up_now();
        let refused = outcome.iter().find_map(|(node, now)| match now {
            Err(LeftOut::Refused(reason)) => Some(format!("{node}: {reason}")),
            _ => None,
        });
        match refused {
            Some(error) => Err(error),
            None => {
                self.apply(outcome);
                Ok(())
            }
        }
    }

    /// Looks again every `interval` until shutdown. The look-up runs on the blocking pool, as
    /// every filesystem pass does, so a slow one cannot stall the RPCs on the runtime thread.
    pub(crate) async fn run(mut self, interval: Duration, shutdown: CancellationToken) {
        let mut rescans = Rescans::every(interval, shutdown);
        while rescans.due().await {
            let (nodes, dev_root) = (self.nodes.clone(), self.dev_root.clone());
            let efas = efa_numbers(&self.efas.current());
            let pass = move || look_up_all(&nodes, &dev_root, &efas);
            match tokio::task::spawn_blocking(pass).await {
                Ok(outcome) => self.apply(outcome),
                // The last result stands until a later pass gets through.
                Err(err) => {
                    tracing::error!(error = %err, "looking up the extra device nodes failed")
                }
            }
        }
    }

    /// One look-up on this thread, against the EFAs the snapshot holds now.
    fn look_up_now(&self) -> Outcome {
        look_up_all(
            &self.nodes,
            &self.dev_root,
            &efa_numbers(&self.efas.current()),
        )
    }

    /// Publishes `outcome` and logs each node whose outcome changed: once when it is found or
    /// its number changes, once when it goes missing, once when it is refused.
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
                Err(LeftOut::Absent(reason)) => tracing::warn!(
                    node = %node,
                    reason = %reason,
                    "extra device node left out of containers until it appears"
                ),
                Err(LeftOut::Refused(reason)) => tracing::warn!(
                    node = %node,
                    reason = %reason,
                    "extra device node withheld from containers: it is an EFA's node or outside \
                     the dev root"
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

fn efa_numbers(inventory: &Inventory) -> EfaNumbers {
    inventory
        .devices()
        .map(|record| (record.efa.dev, record.efa.ibdev.clone()))
        .collect()
}

/// Where the dev tree really is, links resolved: a node must resolve inside `root` and
/// outside `infiniband`.
struct DevTree {
    root: PathBuf,
    infiniband: PathBuf,
}

impl DevTree {
    fn resolve(dev_root: &Path) -> Result<DevTree, LeftOut> {
        let root = std::fs::canonicalize(dev_root).map_err(|err| {
            LeftOut::Absent(format!("the dev root {}: {err}", dev_root.display()))
        })?;
        // The EFAs' dir may itself be a link; absent, it holds no EFA.
        let infiniband = std::fs::canonicalize(dev_root.join("infiniband"))
            .unwrap_or_else(|_| root.join("infiniband"));
        Ok(DevTree { root, infiniband })
    }
}

fn look_up_all(nodes: &[(String, PathBuf)], dev_root: &Path, efas: &EfaNumbers) -> Outcome {
    let tree = DevTree::resolve(dev_root);
    nodes
        .iter()
        .map(|(node, host_path)| {
            let outcome = match &tree {
                Ok(tree) => look_up(node, host_path, tree, efas),
                Err(absent) => Err(absent.clone()),
            };
            (node.clone(), outcome)
        })
        .collect()
}

/// The node containers name `node`, at `host_path`, if it is a character device that is no
/// EFA's; its number is the host's, which the CDI spec needs and the runtime checks a
/// DeviceSpec's path against. It is judged where its links lead, as the runtime opens it.
fn look_up(
    node: &str,
    host_path: &Path,
    tree: &DevTree,
    efas: &EfaNumbers,
) -> Result<DeviceNode, LeftOut> {
    let absent = |err: io::Error| {
        LeftOut::Absent(match err.kind() {
            io::ErrorKind::NotFound => format!("{} is missing", host_path.display()),
            _ => format!("{}: {err}", host_path.display()),
        })
    };
    let real = std::fs::canonicalize(host_path).map_err(absent)?;
    let resolves_to = |what: String| {
        LeftOut::Refused(format!(
            "{} resolves to {}, {what}",
            host_path.display(),
            real.display()
        ))
    };
    if !real.starts_with(&tree.root) {
        return Err(resolves_to(format!(
            "outside the dev root {}",
            tree.root.display()
        )));
    }
    if real.starts_with(&tree.infiniband) {
        return Err(resolves_to(format!(
            "in {}, whose nodes the plugin hands out per EFA",
            tree.infiniband.display()
        )));
    }
    let meta = std::fs::metadata(&real).map_err(absent)?;
    if !meta.file_type().is_char_device() {
        return Err(LeftOut::Absent(format!(
            "{} is {}, not a character device",
            host_path.display(),
            crate::fsread::describe(meta.file_type())
        )));
    }
    let rdev = meta.rdev();
    let dev = DevNum {
        major: nix::sys::stat::major(rdev) as u32,
        minor: nix::sys::stat::minor(rdev) as u32,
    };
    if let Some(ibdev) = efas.get(&dev) {
        return Err(LeftOut::Refused(format!(
            "{} is {dev}, the uverbs node of EFA {ibdev}, which the plugin hands out per EFA",
            host_path.display()
        )));
    }
    Ok(DeviceNode {
        container_path: node.to_owned(),
        host_path: host_path.to_owned(),
        dev,
        permissions: "rw",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::{self, Allocator, Delivery, DeviceSpecs, FoundNodes};
    use crate::cdi::{self, CdiNames, Kind, SpecSettings};
    use crate::config::device_node_under;
    use crate::proto::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    use crate::state::DeviceState;
    use crate::testkit::simulate::{Shape, inventory, make_char_device};

    const GDRDRV: DevNum = DevNum {
        major: 235,
        minor: 0,
    };

    /// A test dev root's `gdrdrv`, a character node, where the test may create one. A link to
    /// the host's `/dev/null` would leave the dev root, which a look-up refuses.
    fn fake_gdrdrv(dev_root: &Path) -> Option<DevNum> {
        match make_char_device(&dev_root.join("gdrdrv"), GDRDRV) {
            Ok(()) => Some(GDRDRV),
            Err(err) => {
                eprintln!("skipped: creating a character device needs CAP_MKNOD: {err}");
                None
            }
        }
    }

    /// A look-up of `names` below `dev_root`, against the EFAs `efas` holds.
    fn lookup(dev_root: &Path, names: &[&str], efas: &DeviceState) -> (Lookup, FoundNodes) {
        let found = Writer::new(Arc::from([]));
        let reader = FoundNodes::new(found.reader());
        let lookup = Lookup::new(
            nodes(dev_root, names),
            dev_root.to_owned(),
            efas.reader(),
            found,
        );
        (lookup, reader)
    }

    /// The device snapshot of a simulated p4d: four EFAs, uverbs0 to uverbs3.
    fn p4d() -> DeviceState {
        let state = DeviceState::unguarded();
        state.apply(inventory(Shape::P4d).devices().cloned().collect());
        state
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
        let Some(number) = fake_gdrdrv(dev.path()) else {
            return;
        };
        let efas = p4d();
        let (mut lookup, found) = lookup(dev.path(), &["/dev/gdrdrv", "/dev/absent"], &efas);
        lookup.start().unwrap();
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
            &cdi::render(
                &inventory(Shape::P4d),
                &settings,
                &Default::default(),
                &Default::default(),
            )
            .unwrap(),
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
        let efas = p4d();
        let (mut lookup, found) = lookup(dev.path(), &["/dev/gdrdrv"], &efas);
        lookup.start().unwrap();
        let contributors = allocation::contributors(dev.path(), &BTreeMap::new(), found);
        let extra = || contributors.container_edits().device_nodes;
        assert!(extra().is_empty(), "missing at start: left out, not fatal");

        let Some(number) = fake_gdrdrv(dev.path()) else {
            return;
        };
        lookup.apply(lookup.look_up_now());
        assert_eq!(extra().len(), 1);
        assert_eq!(extra()[0].dev, number);

        std::fs::remove_file(dev.path().join("gdrdrv")).unwrap();
        std::fs::create_dir(dev.path().join("gdrdrv")).unwrap();
        lookup.apply(lookup.look_up_now());
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
        let state = p4d();
        let (mut lookup, found) = lookup(dev.path(), &["/dev/gdrdrv"], &state);
        lookup.start().unwrap();
        let kind = Kind::of("vpc.amazonaws.com/efa").unwrap();
        let path = kind.spec_path(cdi_dir.path());
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
                holdings: Writer::default().reader(),
                extra: found,
            },
            Box::new(|| Box::pin(async { None })),
            shutdown.clone(),
        ));
        wait_for_spec(&path, &[]).await;

        let Some(number) = fake_gdrdrv(dev.path()) else {
            shutdown.cancel();
            return writer.await.unwrap();
        };
        lookup.apply(lookup.look_up_now());
        wait_for_spec(&path, &[format!("/dev/gdrdrv {number}")]).await;

        std::fs::remove_file(dev.path().join("gdrdrv")).unwrap();
        lookup.apply(lookup.look_up_now());
        wait_for_spec(&path, &[]).await;

        shutdown.cancel();
        writer.await.unwrap();
    }

    /// What a look-up makes of `node` in `dev`, against a p4d's EFAs.
    fn outcome_of(dev: &Path, node: &str) -> Result<DeviceNode, LeftOut> {
        let tree = DevTree::resolve(dev).unwrap();
        let efas = efa_numbers(&inventory(Shape::P4d));
        look_up(node, &device_node_under(dev, node), &tree, &efas)
    }

    #[test]
    fn a_look_up_names_why_a_node_is_left_out() {
        let dev = tempfile::tempdir().unwrap();
        std::fs::write(dev.path().join("gdrdrv"), "").unwrap();
        let Err(LeftOut::Absent(missing)) = outcome_of(dev.path(), "/dev/nvidia-gdr") else {
            panic!("a missing node is absent");
        };
        assert!(missing.ends_with("nvidia-gdr is missing"), "{missing}");
        let Err(LeftOut::Absent(regular)) = outcome_of(dev.path(), "/dev/gdrdrv") else {
            panic!("a regular file is absent");
        };
        assert!(regular.contains("not a character device"), "{regular}");
    }

    /// A dev root holding a p4d's first uverbs node (an empty file: where a link leads decides
    /// first) and the links to judge.
    fn dev_with_links(links: &[(&str, &str)]) -> tempfile::TempDir {
        let dev = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dev.path().join("infiniband")).unwrap();
        std::fs::write(dev.path().join("infiniband/uverbs0"), "").unwrap();
        std::fs::create_dir(dev.path().join("char")).unwrap();
        for (at, target) in links {
            std::os::unix::fs::symlink(target, dev.path().join(at)).unwrap();
        }
        dev
    }

    /// udev links `/dev/char/231:192` to `infiniband/uverbs0` on every host: the name passed the
    /// settings' check, and the look-up followed the link and gave EFA 0 to every container
    /// with EFAs. A link out of the dev root was followed too.
    #[test]
    fn a_node_leading_into_infiniband_or_out_of_the_dev_root_is_refused_at_start() {
        let dir = dev_with_links(&[
            ("char/231:192", "../infiniband/uverbs0"),
            ("rdma", "infiniband"),
            ("gdrdrv", "/dev/null"),
            ("up", ".."),
            ("char/235:0", "../gdrdrv-not-loaded"),
        ]);
        let dev = dir.path();
        let real = std::fs::canonicalize(dev).unwrap();
        let infiniband = format!(
            "in {}, whose nodes the plugin hands out per EFA",
            real.join("infiniband").display()
        );
        let outside = format!("outside the dev root {}", real.display());
        let efas = p4d();
        for (node, leads_to, why) in [
            (
                "/dev/char/231:192",
                real.join("infiniband/uverbs0"),
                &infiniband,
            ),
            ("/dev/rdma", real.join("infiniband"), &infiniband),
            ("/dev/gdrdrv", PathBuf::from("/dev/null"), &outside),
            ("/dev/up", real.parent().unwrap().to_owned(), &outside),
        ] {
            let (mut lookup, found) = lookup(dev, &[node], &efas);
            let error = lookup.start().unwrap_err();
            let host_path = device_node_under(dev, node);
            assert_eq!(
                error,
                format!(
                    "{node}: {} resolves to {}, {why}",
                    host_path.display(),
                    leads_to.display()
                )
            );
            let contributors = allocation::contributors(dev, &BTreeMap::new(), found);
            assert!(contributors.container_edits().device_nodes.is_empty());
        }
        // A link that stays in the dev tree is judged where it leads: missing there for now.
        let (mut lookup, _) = lookup(dev, &["/dev/char/235:0"], &efas);
        assert_eq!(lookup.start(), Ok(()));
        assert!(matches!(
            lookup.last["/dev/char/235:0"],
            Err(LeftOut::Absent(_))
        ));
    }

    /// Not a link, so no path tells: `mknod /dev/efa0 c 231 192` is EFA 0 all the same.
    #[test]
    fn a_node_with_an_efas_number_is_refused_whatever_its_name() {
        let dev = tempfile::tempdir().unwrap();
        let p4d_inventory = inventory(Shape::P4d);
        let first = p4d_inventory.devices().next().unwrap().efa.clone();
        let alias = dev.path().join("efa0");
        if let Err(err) = make_char_device(&alias, first.dev) {
            eprintln!("skipped: creating a character device needs CAP_MKNOD: {err}");
            return;
        }
        let (mut lookup, _) = lookup(dev.path(), &["/dev/efa0"], &p4d());
        assert_eq!(
            lookup.start(),
            Err(format!(
                "/dev/efa0: {} is {}, the uverbs node of EFA {}, which the plugin hands out per \
                 EFA",
                alias.display(),
                first.dev,
                first.ibdev
            ))
        );
    }

    /// One that turns into an EFA's after the start, as when udev adds the link, is withheld
    /// for as long as it leads there.
    #[test]
    fn a_node_that_leads_to_an_efa_later_is_withheld_while_it_does() {
        let dir = dev_with_links(&[]);
        let dev = dir.path();
        let efas = p4d();
        let (mut lookup, found) = lookup(dev, &["/dev/char/231:192"], &efas);
        assert_eq!(lookup.start(), Ok(()), "missing at the start");
        let contributors = allocation::contributors(dev, &BTreeMap::new(), found);
        let link = dev.join("char/231:192");
        std::os::unix::fs::symlink("../infiniband/uverbs0", &link).unwrap();
        lookup.apply(lookup.look_up_now());
        assert!(matches!(
            lookup.last["/dev/char/231:192"],
            Err(LeftOut::Refused(_))
        ));
        assert!(contributors.container_edits().device_nodes.is_empty());

        std::fs::remove_file(&link).unwrap();
        lookup.apply(lookup.look_up_now());
        assert!(matches!(
            lookup.last["/dev/char/231:192"],
            Err(LeftOut::Absent(_))
        ));
    }
}
