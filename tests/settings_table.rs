//! README.md's settings table against the one the binary holds (`efa-device-plugin settings`):
//! every row, both ways, so a setting cannot be added, renamed or given a new default, variable
//! or file key in one place only.

mod support;

use std::collections::BTreeMap;

use support::{readme_table, run_binary};

const README: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
const HEADER: &str = "| flag | env | file key | default | meaning |";
/// What a README cell holds for a setting without a default or a file key.
const NONE: &str = "—";

/// What both tables say of one setting, keyed by its long flag.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    env: String,
    file_key: Option<String>,
    default: Option<String>,
}

type Table = BTreeMap<String, Row>;

fn binary_table() -> Table {
    let (code, stdout, stderr) = run_binary(&["settings", "--output", "json"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let text = |value: &serde_json::Value| value.as_str().map(str::to_owned);
    rows.iter()
        .map(|row| {
            let flag = text(&row["flag"]).expect("a flag");
            let row = Row {
                env: text(&row["env"]).expect("a variable"),
                file_key: text(&row["file_key"]),
                default: text(&row["default"]),
            };
            (flag, row)
        })
        .collect()
}

/// The rows of the table under [`HEADER`]: `` `--flag VALUE` ``, `` `VARIABLE` ``, the file key
/// and the default in backticks or [`NONE`], then the help, which is the README's own.
fn readme_table(readme: &str) -> Table {
    let code = |cell: &str| {
        let cell = cell.trim();
        (cell != NONE).then(|| cell.trim_matches('`').to_owned())
    };
    readme_table::rows(readme, HEADER)
        .into_iter()
        .map(|cells| {
            assert!(
                cells.len() >= 5,
                "a README row with too few cells: {cells:?}"
            );
            let flag = code(&cells[0]).unwrap_or_default();
            let flag = flag
                .strip_prefix("--")
                .and_then(|flag| flag.split(' ').next())
                .unwrap_or_else(|| panic!("no --flag in the README row {cells:?}"));
            let row = Row {
                env: code(&cells[1]).unwrap_or_default(),
                file_key: code(&cells[2]),
                default: code(&cells[3]),
            };
            (flag.to_owned(), row)
        })
        .collect()
}

/// Each way the README's table differs from the binary's, one line each.
fn differences(readme: &Table, binary: &Table) -> Vec<String> {
    readme_table::differences(readme, binary, |flag| format!("--{flag}"))
}

#[test]
fn the_readme_settings_table_is_the_binarys() {
    let binary = binary_table();
    assert!(binary.len() > 20, "{binary:?}");
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
    let default = drifted(
        "| `rescan-interval` | `5s` |",
        "| `rescan-interval` | `10s` |",
    );
    assert_eq!(default.len(), 1, "{default:?}");
    assert!(default[0].starts_with("--rescan-interval: the README says"));
    let key = drifted("| `sharing.replicas` |", "| `sharing-replicas` |");
    assert!(key[0].starts_with("--sharing-replicas:"), "{key:?}");
    let variable = drifted("| `EFA_DP_DEV_ROOT` |", "| `EFA_DP_DEVROOT` |");
    assert!(variable[0].starts_with("--dev-root:"), "{variable:?}");
    let renamed = drifted(
        "| `--dra-drivers NAME,...` |",
        "| `--dra-driver NAME,...` |",
    );
    assert_eq!(
        renamed,
        [
            "--dra-drivers is not in the README: Row { env: \"EFA_DP_DRA_DRIVERS\", file_key: Some(\"dra-drivers\"), default: Some(\"dra.net,dra.networking.k8s.aws\") }",
            "--dra-driver is in the README but not in the binary",
        ]
    );
}
