//! Which PCI function each advertised ID names, kept in a small file beside the plugin's socket,
//! so that a restarted plugin knows which EFA a held ID is even when sysfs renamed the EFA while
//! no plugin ran (a rollout, a crash, an upgrade). Without it a held EFA renamed meanwhile comes
//! back as a new, free EFA: the kubelet gives its uverbs node to a second pod.
//!
//! Why a file of the plugin's own: the kubelet's checkpoint records each container's IDs and its
//! Allocate answer, but not which device node each ID got (a container given two EFAs that were
//! both renamed shows two IDs and two nodes, paired nowhere), in a format internal to the
//! kubelet; the CDI spec kept on exit pairs them, in cdi mode only. The kubelet's device manager
//! removes only sockets from this dir when it starts, so the file outlives kubelet restarts, and
//! a file removed anyway is written again at the next recheck.
//!
//! The file names the ID strategy it was written under, and a run under the other one ignores
//! it: a switch of strategy is not a rename, and IDs held under the other strategy are foreign
//! (counted, steered around, kept in the CDI spec), as they are for the AWS plugin's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use serde::{Deserialize, Serialize};

use crate::discovery::DeviceIdStrategy;
use crate::hostfile::HostFile;
use crate::state::{DeviceReader, Inventory, Reader, Registration};

/// The file's name in the device-plugin dir.
pub(crate) const FILE_NAME: &str = "efa-device-plugin.ids.json";

/// The largest file read: a few dozen bytes per EFA, for at most a few hundred EFAs.
const LIMIT: u64 = 1 << 20;

/// Readable by anyone, as the plugin's other files: it holds device names and PCI addresses.
const MODE: u32 = 0o644;

/// What the file holds: the advertised IDs, each with its PCI address, and the strategy that
/// named them.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Advertised<'a> {
    strategy: &'a str,
    #[serde(borrow)]
    ids: BTreeMap<&'a str, &'a str>,
}

/// The word for `ids` in the file.
fn strategy_name(ids: DeviceIdStrategy) -> &'static str {
    match ids {
        DeviceIdStrategy::Ibdev => "ibdev",
        DeviceIdStrategy::Pci => "pci",
    }
}

/// The IDs an earlier run under `strategy` advertised, by the PCI address each named, from the
/// file in `dir`; nothing if there is none, it was written under the other strategy, or it
/// cannot be read or parsed, which is logged: the plugin then knows only what sysfs says now.
pub(crate) fn read(dir: &Path, strategy: DeviceIdStrategy) -> BTreeMap<String, String> {
    let path = dir.join(FILE_NAME);
    let text = match crate::fsread::read_text(&path, LIMIT) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(err) => return unreadable(&path, &err.to_string()),
    };
    match serde_json::from_str::<Advertised<'_>>(&text) {
        Ok(file) if file.strategy == strategy_name(strategy) => file
            .ids
            .into_iter()
            .map(|(id, pci)| (pci.to_owned(), id.to_owned()))
            .collect(),
        Ok(_) => BTreeMap::new(),
        Err(err) => unreadable(&path, &err.to_string()),
    }
}

fn unreadable(path: &Path, error: &str) -> BTreeMap<String, String> {
    tracing::warn!(
        file = %path.display(),
        %error,
        "cannot read the IDs an earlier run advertised; an EFA renamed while no plugin ran is known by its new name only"
    );
    BTreeMap::new()
}

/// The file's text for `inventory`, named under `strategy`: each advertised ID with its PCI
/// address. `None` without devices, when there is nothing to remember.
fn render(inventory: &Inventory, strategy: DeviceIdStrategy) -> Option<String> {
    let ids: BTreeMap<&str, &str> = inventory
        .devices()
        .map(|record| (record.efa.id.as_str(), record.efa.pci_address.as_str()))
        .collect();
    if ids.is_empty() {
        return None;
    }
    let file = Advertised {
        strategy: strategy_name(strategy),
        ids,
    };
    let mut text = serde_json::to_string_pretty(&file).ok()?;
    text.push('\n');
    Some(text)
}

/// Keeps the file in `dir` current until `shutdown`, and leaves it on exit: the next run reads it.
/// Written once the plugin has registered: on a full disk the socket comes first for a freed
/// inode, and until then the file an earlier run left stands.
pub(crate) async fn run(
    dir: PathBuf,
    strategy: DeviceIdStrategy,
    recheck: Duration,
    state: DeviceReader,
    registration: Reader<Registration>,
    shutdown: CancellationToken,
) {
    let mut registered = registration.subscribe();
    tokio::select! {
        _ = shutdown.cancelled() => return,
        // Fails only once the writer is gone, which a `Reader` rules out.
        _ = registered.wait_for(|now| now.registered) => {}
    }
    let file = HostFile {
        path: dir.join(FILE_NAME),
        what: "file of advertised IDs",
        recheck,
        mode: MODE,
        failures: None,
        keep_on_exit: Some(Box::new(|| {
            Box::pin(async { Some("the next run reads it".to_owned()) })
        })),
        holdings: None,
        also: None,
    };
    file.follow(state, |inventory, _| render(inventory, strategy), shutdown)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::DeviceIdStrategy;
    use crate::testkit::simulate::{Shape, inventory_named};

    #[test]
    fn what_is_written_is_read_back_by_pci_address() {
        let dir = tempfile::tempdir().unwrap();
        let ibdev = DeviceIdStrategy::Ibdev;
        let inventory = inventory_named(Shape::P4d, ibdev);
        std::fs::write(
            dir.path().join(FILE_NAME),
            render(&inventory, ibdev).unwrap(),
        )
        .unwrap();
        let remembered = read(dir.path(), ibdev);
        assert_eq!(remembered.len(), 4);
        for record in inventory.devices() {
            assert_eq!(
                remembered.get(&record.efa.pci_address),
                Some(&record.efa.id)
            );
        }
        assert_eq!(render(&Inventory::default(), ibdev), None);
        // A switch of strategy is no rename: the other strategy's IDs are not taken.
        assert!(read(dir.path(), DeviceIdStrategy::Pci).is_empty());
    }

    #[test]
    fn a_missing_or_garbled_file_remembers_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path(), DeviceIdStrategy::Ibdev).is_empty());
        for garbled in ["", "{", "[1,2]", "{\"a\": 1}", "\u{0}"] {
            std::fs::write(dir.path().join(FILE_NAME), garbled).unwrap();
            assert!(
                read(dir.path(), DeviceIdStrategy::Ibdev).is_empty(),
                "{garbled:?}"
            );
        }
        std::fs::remove_file(dir.path().join(FILE_NAME)).unwrap();
        std::fs::create_dir(dir.path().join(FILE_NAME)).unwrap();
        assert!(read(dir.path(), DeviceIdStrategy::Ibdev).is_empty());
    }
}
