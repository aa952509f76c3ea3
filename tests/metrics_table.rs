//! The metrics table the binary holds (`telemetry::families::FAMILIES`) against README.md's
//! metrics table, every row both ways, and against what a real scrape shows: a family cannot be
//! added, renamed, retyped or relabelled in one place only.
//!
//! The README's `meaning` column is its own longer text, as the settings table's help is, so
//! it is not compared; a scrape's HELP text is, since it comes from the table.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use efa_device_plugin::telemetry::families::{COUNTER, FAMILIES, Family};
use efa_device_plugin::testkit::pod_resources_stub::{PodResourcesStub, pod};
use efa_device_plugin::testkit::simulate::Shape;
use support::{Harness, readme_table};

const README: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
const HEADER: &str = "| metric | type | labels | meaning |";

/// What both tables say of one family, keyed by its name.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    kind: String,
    labels: Vec<String>,
}

type Table = BTreeMap<String, Row>;

fn binary_table() -> Table {
    FAMILIES
        .iter()
        .map(|family| {
            let row = Row {
                kind: family.kind.as_str().to_owned(),
                labels: family.labels.iter().map(|&l| l.to_owned()).collect(),
            };
            (family.name.to_owned(), row)
        })
        .collect()
}

/// The rows of the table under [`HEADER`]: the name in backticks, the type, then the labels,
/// each the first backticked word of a comma-separated part (`` `health` = `healthy` \|
/// `unhealthy` `` is the label `health` with its values; `` `driver` (while 1) `` is `driver`).
fn readme_table(readme: &str) -> Table {
    let first_code = |cell: &str| cell.split('`').nth(1).map(str::to_owned);
    readme_table::rows(readme, HEADER)
        .into_iter()
        .map(|cells| {
            assert!(
                cells.len() >= 4,
                "a README row with too few cells: {cells:?}"
            );
            let name = first_code(&cells[0]).unwrap_or_else(|| panic!("no name in {cells:?}"));
            let row = Row {
                kind: cells[1].trim().to_owned(),
                labels: cells[2].split(',').filter_map(first_code).collect(),
            };
            (name, row)
        })
        .collect()
}

/// Each way the README's table differs from the binary's, one line each.
fn differences(readme: &Table, binary: &Table) -> Vec<String> {
    readme_table::differences(readme, binary, str::to_owned)
}

#[test]
fn the_readme_metrics_table_is_the_binarys() {
    let binary = binary_table();
    assert_eq!(binary.len(), FAMILIES.len(), "each family named once");
    let differences = differences(&readme_table(README), &binary);
    assert!(differences.is_empty(), "README.md: {differences:#?}");
}

#[test]
fn a_drifted_readme_row_is_found() {
    let binary = binary_table();
    let drifted = |from: &str, to: &str| {
        assert!(README.contains(from), "{from}");
        differences(&readme_table(&README.replacen(from, to, 1)), &binary)
    };
    let registered = README
        .lines()
        .find(|line| line.starts_with("| `efa_device_plugin_registered` |"))
        .expect("the registered row");
    assert_eq!(
        drifted(&format!("{registered}\n"), ""),
        ["efa_device_plugin_registered is not in the README: Row { kind: \"gauge\", labels: [] }"]
    );
    let renamed = drifted(
        "| `efa_device_plugin_foreign_allocations` |",
        "| `efa_device_plugin_foreign_ids` |",
    );
    assert_eq!(
        renamed,
        [
            "efa_device_plugin_foreign_allocations is not in the README: Row { kind: \"gauge\", labels: [] }",
            "efa_device_plugin_foreign_ids is in the README but not in the binary",
        ]
    );
    let kind = drifted(
        "| `efa_device_plugin_registered` | gauge |",
        "| `efa_device_plugin_registered` | counter |",
    );
    assert_eq!(kind.len(), 1, "{kind:?}");
    assert!(kind[0].starts_with("efa_device_plugin_registered: the README says"));
    let labels = drifted(
        "| `efa_device_plugin_device_healthy` | gauge | `device`, `ibdev` |",
        "| `efa_device_plugin_device_healthy` | gauge | `device` |",
    );
    assert_eq!(labels.len(), 1, "{labels:?}");
    assert!(labels[0].starts_with("efa_device_plugin_device_healthy: the README says"));
    let value_as_label = drifted(
        "`health` = `healthy` \\| `unhealthy`",
        "`health`, `healthy`",
    );
    assert!(
        value_as_label[0].starts_with("efa_device_plugin_devices:"),
        "{value_as_label:?}"
    );
}

#[test]
fn a_drifted_binary_row_is_found() {
    let readme = readme_table(README);
    let drifted = |change: &dyn Fn(&mut Table)| {
        let mut binary = binary_table();
        change(&mut binary);
        differences(&readme, &binary)
    };
    let added = drifted(&|t| {
        t.insert(
            "efa_device_plugin_new_total".into(),
            Row {
                kind: "counter".into(),
                labels: vec![],
            },
        );
    });
    assert_eq!(
        added,
        ["efa_device_plugin_new_total is not in the README: Row { kind: \"counter\", labels: [] }"]
    );
    let removed = drifted(&|t| {
        t.remove("efa_device_allocation");
    });
    assert_eq!(
        removed,
        ["efa_device_allocation is in the README but not in the binary"]
    );
    let relabelled = drifted(&|t| {
        let row = t.get_mut("efa_device_plugin_scan_errors_total").unwrap();
        row.labels.push("device".into());
    });
    assert_eq!(relabelled.len(), 1, "{relabelled:?}");
    assert!(relabelled[0].starts_with("efa_device_plugin_scan_errors_total: the README says"));
}

/// A scrape with every family in it: cdi mode (the spec's failed writes), a container holding
/// an EFA (its allocation series), a DRA driver registered (the conflict's driver label) and an
/// unreadable `numa_node` (a scan error's reason). Also every hardware counter name the node's
/// EFAs have.
async fn full_scrape() -> (String, BTreeSet<String>) {
    let mut h = Harness::new(Shape::P4d);
    let efas: Vec<_> = h.efas().into_iter().cloned().collect();
    let socket = h.root.path().join("pod-resources/kubelet.sock");
    let holder = pod(
        "ml",
        "trainer-0",
        "main",
        "vpc.amazonaws.com/efa",
        &[&efas[0].ibdev],
    );
    let _kubelet = PodResourcesStub::start(&socket, vec![holder]).unwrap();
    let dir = h.root.path().join("cdi").display().to_string();
    h.spawn_plugin(&["--device-list-strategy", "cdi", "--cdi-spec-dir", &dir]);
    h.registered().await;
    let device = h.node.sysfs.join("class/infiniband").join(&efas[1].ibdev);
    let numa = device.join("device/numa_node");
    std::fs::remove_file(&numa).unwrap();
    std::fs::create_dir(&numa).unwrap();
    let registry = h.root.path().join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let _dranet =
        std::os::unix::net::UnixListener::bind(registry.join("dra.net-reg.sock")).unwrap();
    let text = h
        .scrape_until("every family", |t| {
            t.contains("efa_device_allocation{")
                && t.contains("{reason=\"numa_node\"}")
                && t.contains("{driver=\"dra.net\"} 1")
        })
        .await;
    let counters = efas
        .iter()
        .flat_map(|efa| {
            let device = h.node.sysfs.join("class/infiniband").join(&efa.ibdev);
            [
                device.join("hw_counters"),
                device.join("ports/1/hw_counters"),
            ]
        })
        .flat_map(|dir| std::fs::read_dir(dir).unwrap())
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    (text, counters)
}

/// One family of a scrape: its TYPE and HELP, and the label names of each of its series.
#[derive(Debug, Default)]
struct Shown {
    kind: String,
    help: String,
    series: Vec<Vec<String>>,
}

/// The families of exposition `text`, in their order.
fn shown(text: &str) -> Vec<(String, Shown)> {
    let mut families: Vec<(String, Shown)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let shown = Shown {
                help: help.to_owned(),
                ..Shown::default()
            };
            families.push((name.to_owned(), shown));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            let (last, shown) = families.last_mut().expect("HELP before TYPE");
            assert_eq!(last, name, "TYPE after another family's HELP");
            shown.kind = kind.to_owned();
        } else {
            let (series, _value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let (family, shown) = families.last_mut().expect("a series after its HELP");
            let histogram = ["_bucket", "_sum", "_count"]
                .iter()
                .any(|suffix| name.strip_suffix(suffix) == Some(family.as_str()));
            assert!(name == family || histogram, "{name} under {family}'s HELP");
            let names = label_names(labels)
                .into_iter()
                .filter(|label| !(histogram && label == "le"))
                .collect();
            shown.series.push(names);
        }
    }
    families
}

/// The label names of `name="value",...}`; values are quoted, with `\"` and `\\` escaped.
fn label_names(mut rest: &str) -> Vec<String> {
    let mut names = Vec::new();
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').to_owned());
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect("a closing quote") {
                (_, '\\') => {
                    chars.next();
                }
                (at, '"') => break at,
                _ => {}
            }
        };
        rest = &after[end + 1..];
    }
    names
}

/// `template` with [`COUNTER`] replaced by `counter`.
fn fill(template: &str, counter: &str) -> String {
    template.replace(COUNTER, counter)
}

/// The table's row for the family a scrape names `name`, and the hardware counter it stands
/// for: one of `counters`, the names the node's EFAs have.
fn row_of<'c>(name: &str, counters: &'c BTreeSet<String>) -> Option<(&'static Family, &'c str)> {
    FAMILIES
        .iter()
        .find(|family| family.name == name)
        .map(|family| (family, ""))
        .or_else(|| {
            FAMILIES.iter().find_map(|family| {
                let counter = counters.iter().find(|c| fill(family.name, c) == name)?;
                family
                    .name
                    .contains(COUNTER)
                    .then_some((family, counter.as_str()))
            })
        })
}

/// Each way a scrape differs from the table, one line each: a family the table lacks or
/// misdescribes, a series with other labels than its row's, a row the scrape does not show,
/// families out of the table's order.
fn scrape_differences(text: &str, counters: &BTreeSet<String>) -> Vec<String> {
    let mut found = Vec::new();
    let mut order: Vec<&str> = Vec::new();
    for (name, shown) in shown(text) {
        let Some((family, counter)) = row_of(&name, counters) else {
            found.push(format!("{name} is in a scrape but not in the table"));
            continue;
        };
        if order.last() != Some(&family.name) {
            order.push(family.name);
        }
        let (kind, help) = (family.kind.as_str(), fill(family.help, counter));
        if shown.kind != kind || shown.help != help {
            found.push(format!(
                "{name}: the table says {kind} {help:?}, the scrape {} {:?}",
                shown.kind, shown.help
            ));
        }
        for labels in shown.series.iter().filter(|l| *l != family.labels) {
            found.push(format!(
                "{name}: a series labelled {labels:?}, the table says {:?}",
                family.labels
            ));
        }
    }
    let table: Vec<&str> = FAMILIES.iter().map(|family| family.name).collect();
    for name in table.iter().filter(|name| !order.contains(name)) {
        found.push(format!("{name} is in the table but not in a scrape"));
    }
    if found.is_empty() && order != table {
        found.push(format!("a scrape shows {order:?}, the table {table:?}"));
    }
    found
}

#[tokio::test]
async fn a_scrape_shows_the_tables_families_in_its_order_and_no_other() {
    let (text, counters) = full_scrape().await;
    assert!(counters.contains("tx_bytes"), "{counters:?}");
    let differences = scrape_differences(&text, &counters);
    assert!(differences.is_empty(), "{differences:#?}\n{text}");
    // Every counter file is a family of its own.
    for counter in &counters {
        let name = format!("efa_{counter}_total");
        assert!(text.contains(&format!("# TYPE {name} counter\n")), "{name}");
    }
}

#[tokio::test]
async fn a_scrape_that_drifts_from_the_table_is_found() {
    let (text, counters) = full_scrape().await;
    let drifted = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        scrape_differences(&text.replace(from, to), &counters)
    };
    assert_eq!(
        drifted("efa_device_plugin_registered", "efa_device_plugin_ready"),
        [
            "efa_device_plugin_ready is in a scrape but not in the table",
            "efa_device_plugin_registered is in the table but not in a scrape",
        ]
    );
    let kind = drifted(
        "# TYPE efa_device_plugin_registered gauge",
        "# TYPE efa_device_plugin_registered counter",
    );
    assert_eq!(kind.len(), 1, "{kind:?}");
    assert!(kind[0].starts_with("efa_device_plugin_registered: the table says gauge"));
    let help = drifted(
        "EFA hardware counter tx_bytes (sysfs",
        "EFA counter tx_bytes (sysfs",
    );
    assert_eq!(help.len(), 1, "{help:?}");
    assert!(help[0].starts_with("efa_tx_bytes_total: the table says counter"));
    let labels = drifted("{reason=\"numa_node\"}", "{why=\"numa_node\"}");
    assert_eq!(
        labels,
        [
            "efa_device_plugin_scan_errors_total: a series labelled [\"why\"], the table says [\"reason\"]"
        ]
    );
    let fewer = drifted(",container=\"main\"}", "}");
    assert_eq!(fewer.len(), 1, "{fewer:?}");
    assert!(fewer[0].starts_with("efa_device_allocation: a series labelled"));
    // A family moved: the build info after the conflict gauge.
    let build = text
        .lines()
        .filter(|line| line.contains("efa_device_plugin_build_info"))
        .map(|line| format!("{line}\n"))
        .collect::<String>();
    let moved = text.replace(&build, "").replace(
        "# HELP efa_device_plugin_competing_plugin",
        &format!("{build}# HELP efa_device_plugin_competing_plugin"),
    );
    let order = scrape_differences(&moved, &counters);
    assert_eq!(order.len(), 1, "{order:?}");
    assert!(order[0].starts_with("a scrape shows"), "{order:?}");
}
