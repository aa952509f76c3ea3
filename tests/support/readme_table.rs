//! README.md's tables that the binary holds too (settings, metrics): each row's cells, and how
//! the README's rows differ from the binary's, both ways.

use std::collections::BTreeMap;
use std::fmt::Debug;

/// The cells of each row of the table whose header line is `header`. An escaped `\|` is part
/// of a cell (`text\|json`), not a border; it reads as `/`.
pub(crate) fn rows(readme: &str, header: &str) -> Vec<Vec<String>> {
    let start = readme
        .find(header)
        .unwrap_or_else(|| panic!("no README table {header}"));
    readme[start..]
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            line.replace("\\|", "/")
                .trim_matches('|')
                .split('|')
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

/// Each way the README's rows differ from the binary's, one line each, the key written by
/// `named` as a reader would look for it.
pub(crate) fn differences<R: Debug + PartialEq>(
    readme: &BTreeMap<String, R>,
    binary: &BTreeMap<String, R>,
    named: impl Fn(&str) -> String,
) -> Vec<String> {
    let mut found = Vec::new();
    for (key, row) in binary {
        let name = named(key);
        match readme.get(key) {
            None => found.push(format!("{name} is not in the README: {row:?}")),
            Some(documented) if documented != row => found.push(format!(
                "{name}: the README says {documented:?}, the binary {row:?}"
            )),
            Some(_) => {}
        }
    }
    for key in readme.keys().filter(|key| !binary.contains_key(*key)) {
        found.push(format!(
            "{} is in the README but not in the binary",
            named(key)
        ));
    }
    found
}
