//! Scan and health judgement over a tree of arbitrary names, links and contents, laid out on
//! disk the way sysfs would be: a simulated p4d, so the scan gets past its first checks, then
//! arbitrary entries added, overwritten or removed. Only dirs, regular files and symlinks:
//! FIFOs and device nodes would block or reach real hardware, not exercise the parsers. Every
//! link resolves inside the tree, so nothing outside it is read.

#![no_main]

use std::fs;
use std::path::{Path, PathBuf};

use arbitrary::Arbitrary;
use efa_device_plugin::testkit::simulate::{self, Nodes, Shape};
use libfuzzer_sys::fuzz_target;

/// Names the scan looks for, so the fuzzer reaches past the first `read_dir`.
const NAMES: &[&str] = &[
    "sys",
    "dev",
    "class",
    "infiniband",
    "infiniband_verbs",
    "devices",
    "device",
    "driver",
    "efa",
    "mlx5_core",
    "uverbs0",
    "uverbs1",
    "numa_node",
    "vendor",
    "pci0000:10",
    "0000:10:1b.0",
    "rdmap16s27",
    "efa_0",
    "local_cpulist",
];

#[derive(Arbitrary, Debug)]
enum Name {
    Known(u8),
    Raw(String),
}

#[derive(Arbitrary, Debug)]
enum Kind {
    Dir,
    File(Vec<u8>),
    /// Up this many levels (at most to the tree's root), then down these names.
    Link(u8, Vec<Name>),
    Remove,
}

#[derive(Arbitrary, Debug)]
struct Entry {
    path: Vec<Name>,
    kind: Kind,
}

fn name(name: &Name) -> Option<String> {
    let text = match name {
        Name::Known(i) => NAMES[usize::from(*i) % NAMES.len()].to_owned(),
        Name::Raw(text) => text.clone(),
    };
    let usable = !text.is_empty() && text != "." && text != ".." && !text.contains(['/', '\0']);
    usable.then_some(text)
}

fn names(parts: &[Name]) -> Option<Vec<String>> {
    parts.iter().take(8).map(name).collect()
}

/// Creates `entry` below `root` unless a parent is a link: then the entry's depth on disk
/// would differ from its depth here, and its link could leave the tree.
fn lay_out(root: &Path, entry: &Entry) -> Option<()> {
    let parts = names(&entry.path)?;
    let (last, parents) = parts.split_last()?;
    let mut dir = root.to_path_buf();
    for part in parents {
        dir.push(part);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return None,
            Err(_) => fs::create_dir(&dir).ok()?,
        }
    }
    let path = dir.join(last);
    // Whatever is there is replaced: a link is never followed, a dir goes with its contents.
    if fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_dir()) {
        fs::remove_dir_all(&path).ok()?;
    } else {
        let _ = fs::remove_file(&path);
    }
    match &entry.kind {
        Kind::Remove => Some(()),
        Kind::Dir => fs::create_dir(&path).ok(),
        Kind::File(contents) => fs::write(&path, contents).ok(),
        Kind::Link(up, down) => {
            let mut target = PathBuf::new();
            for _ in 0..usize::from(*up).min(parents.len()) {
                target.push("..");
            }
            for part in names(down)? {
                target.push(part);
            }
            std::os::unix::fs::symlink(target, &path).ok()
        }
    }
}

fuzz_target!(|entries: Vec<Entry>| {
    let root = tempfile::Builder::new()
        .prefix("efa-fuzz.")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("temp dir");
    let (node, _) =
        simulate::FakeNode::build(&root.path(), Shape::P4d, Nodes::Files).expect("simulated node");
    for entry in entries.iter().take(64) {
        lay_out(root.path(), entry);
    }
    // The simulated node's uverbs nodes are regular files (Nodes::Files), which its judge takes
    // for the character devices they stand in for.
    let observed = efa_device_plugin::health::observe(
        &node.sysfs,
        efa_device_plugin::discovery::DeviceIdStrategy::default(),
        &node.judge(),
    );
    let (records, problems) = (observed.records, observed.problems);
    // Every device the scan keeps is one the kubelet could be given: a non-empty, unique ID.
    let mut ids: Vec<&str> = records.iter().map(|r| r.efa.id.as_str()).collect();
    assert!(ids.iter().all(|id| !id.is_empty()));
    ids.dedup();
    assert_eq!(ids.len(), records.len(), "duplicate IDs: {records:?}");
    for problem in &problems {
        assert!(!problem.to_string().is_empty());
    }
});
