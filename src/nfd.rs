//! A node-feature-discovery local feature file, so a cluster can select EFA nodes by label
//! without the plugin holding API credentials.
//!
//! NFD's `local` source reads `key=value` lines from files in its `features.d` dir and labels
//! the node `feature.node.kubernetes.io/<key>=<value>`. Values must therefore be valid label
//! values: lists are joined with `_`, never `,`. [`HostFile`] replaces it by rename, so NFD never
//! reads half of it, and removes it on exit, so a node without the plugin loses the labels.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::hostfile::HostFile;
use crate::state::{DeviceReader, Inventory};

/// The feature file for this inventory: capacity (every device the kubelet is told about), the
/// NUMA nodes the EFAs sit on, and their PCI device models (`efa1`, `efa2`, ...).
pub(crate) fn render(inventory: &Inventory) -> String {
    let numa: BTreeSet<u32> = inventory
        .devices()
        .filter_map(|d| d.efa.numa_node)
        .collect();
    let models: BTreeSet<String> = inventory
        .devices()
        .map(|d| d.efa.device.trim_start_matches("0x").to_ascii_lowercase())
        .filter(|model| !model.is_empty())
        .collect();
    let join = |items: Vec<String>| items.join("_");
    let mut text = format!(
        "# Written by efa-device-plugin; removed when it stops.\nefa.count={}\n",
        inventory.devices().len()
    );
    if !numa.is_empty() {
        let nodes = join(numa.iter().map(u32::to_string).collect());
        text.push_str(&format!("efa.numa-nodes={nodes}\n"));
    }
    if !models.is_empty() {
        text.push_str(&format!(
            "efa.device-model={}\n",
            join(models.into_iter().collect())
        ));
    }
    text
}

/// Keeps `path` current with the device state until `shutdown`, then removes it; a failed
/// write is tried again, and the file on disk compared with the rendering, every `recheck`.
pub(crate) async fn run(
    path: PathBuf,
    recheck: Duration,
    state: DeviceReader,
    shutdown: CancellationToken,
) {
    let file = HostFile {
        path,
        what: "NFD feature file",
        recheck,
        // Read by NFD's worker, which runs as nobody (uid 65534).
        mode: 0o644,
        failures: None,
        keep_on_exit: None,
        holdings: None,
        also: None,
    };
    file.follow(state, |inventory, _| Some(render(inventory)), shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::DeviceIdStrategy;
    use crate::health;
    use crate::state::DeviceState;
    use crate::testkit::simulate::{FakeNode, Nodes, Shape};

    fn inventory(shape: Shape) -> Inventory {
        let root = tempfile::tempdir().unwrap();
        let (node, _) = FakeNode::build(root.path(), shape, Nodes::Files).unwrap();
        let state = DeviceState::unguarded();
        state.apply(
            health::observe(&node.sysfs, DeviceIdStrategy::default(), &node.judge()).records,
        );
        (*state.current()).clone()
    }

    #[test]
    fn describes_count_numa_and_model_as_valid_label_values() {
        let text = render(&inventory(Shape::P5));
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            [
                "efa.count=32",
                "efa.numa-nodes=0_1",
                "efa.device-model=efa2"
            ]
        );
    }

    #[test]
    fn a_node_without_numa_affinity_has_no_numa_key() {
        let text = render(&inventory(Shape::G5));
        assert!(text.contains("efa.count=1\n"));
        assert!(!text.contains("numa"));
        assert_eq!(
            render(&Inventory::default())
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>(),
            ["efa.count=0"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_write_is_retried_without_a_device_change() {
        const RETRY: Duration = Duration::from_secs(10);
        let dir = tempfile::tempdir().unwrap();
        // A file where the dir should be stands in for a full disk: the write fails until the
        // dir replaces it.
        let features = dir.path().join("features.d");
        std::fs::write(&features, "").unwrap();
        let path = features.join("efa");
        let state = DeviceState::unguarded();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(path.clone(), RETRY, state.reader(), shutdown.clone()));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!path.exists());
        std::fs::remove_file(&features).unwrap();
        std::fs::create_dir(&features).unwrap();
        tokio::time::sleep(RETRY).await;
        assert!(
            std::fs::read_to_string(&path).is_ok_and(|t| t.contains("efa.count=0")),
            "not written again"
        );
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn follows_the_state_and_is_removed_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("efa");
        let state = DeviceState::unguarded();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            path.clone(),
            std::time::Duration::from_secs(1),
            state.reader(),
            shutdown.clone(),
        ));
        let wait_for = |needle: &'static str| {
            let path = path.clone();
            async move {
                for _ in 0..200 {
                    if std::fs::read_to_string(&path).is_ok_and(|t| t.contains(needle)) {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                panic!("{} never contained {needle}", path.display());
            }
        };
        wait_for("efa.count=0").await;
        let other = inventory(Shape::P4d);
        state.apply(other.devices().cloned().collect());
        wait_for("efa.count=4").await;
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file is left behind");
        shutdown.cancel();
        task.await.unwrap();
        assert!(!path.exists());
    }
}
