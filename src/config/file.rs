//! The config file given by `--config`: read within its limits, and filed by dotted key.

use std::collections::BTreeMap;
use std::path::Path;

use serde_yaml::Value;

use super::depth::nesting_depth;
use super::origin::ConfigError;

/// A config file is a few hundred bytes; the cap keeps a wrong path (a log, a disk image) from
/// being read whole.
pub(super) const CONFIG_SIZE_LIMIT: u64 = 1 << 20;
/// The schema nests two levels; the YAML parser's cost grows with the square of the depth, so
/// deeper input is refused before it is parsed (see [`nesting_depth`]).
pub(super) const CONFIG_DEPTH_LIMIT: usize = 32;

/// The key naming the file's format, and the formats this plugin reads; a file without the key
/// is the first. A later format can then change the keys without an old file being misread.
pub(super) const VERSION_KEY: &str = "version";
pub(super) const VERSIONS: [&str; 1] = ["v1"];

/// The config file's values by their dotted key, e.g. `sharing.replicas`.
pub(super) type FileValues = BTreeMap<&'static str, Value>;

/// A config file as read: its text, and its values by dotted key.
pub(super) struct Document {
    pub text: String,
    pub values: FileValues,
}

/// Reads the file at `path` into its values under `keys`, the dotted keys the file may hold.
pub(super) fn read(path: &Path, keys: &[&'static str]) -> Result<Document, ConfigError> {
    let problem = |what: String| ConfigError(format!("config file {}: {what}", path.display()));
    let text = crate::fsread::read_text(path, CONFIG_SIZE_LIMIT)
        .map_err(|err| problem(err.to_string()))?;
    let mut values = FileValues::new();
    let depth = nesting_depth(&text);
    if depth > CONFIG_DEPTH_LIMIT {
        return Err(problem(format!(
            "nested {depth} levels deep, more than the {CONFIG_DEPTH_LIMIT} allowed"
        )));
    }
    let mut document: Value =
        serde_yaml::from_str(&text).map_err(|err| problem(err.to_string().replace('\n', " ")))?;
    check_version(&mut document).map_err(problem)?;
    collect(&document, "", keys, &mut values).map_err(problem)?;
    Ok(Document { text, values })
}

/// Takes the version key out of the document, refusing a format this plugin does not read. As
/// with a setting, a null (`version:` alone) leaves it unset.
fn check_version(document: &mut Value) -> Result<(), String> {
    let Value::Mapping(entries) = document else {
        return Ok(());
    };
    match entries.remove(VERSION_KEY) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(version)) if VERSIONS.contains(&version.as_str()) => Ok(()),
        Some(Value::String(version)) => Err(format!(
            "{VERSION_KEY}: unknown version {version:?}, this plugin reads {}",
            VERSIONS.join(", ")
        )),
        Some(_) => Err(format!(
            "{VERSION_KEY}: must be a string, one of {}",
            VERSIONS.join(", ")
        )),
    }
}

/// Files the entries of one mapping, the document or a group such as `sharing:`, under their
/// dotted keys. An unknown key is an error, so a typo cannot silently fall back to a default.
/// An empty document (a file of comments only) or group (`sharing:` alone), like a setting left
/// empty, sets nothing.
fn collect(
    mapping: &Value,
    prefix: &str,
    keys: &[&'static str],
    values: &mut FileValues,
) -> Result<(), String> {
    // The group as the error names it, `sharing: `, with the keys it holds; the document has
    // no name, and its keys are those of --help.
    let (group, members) = match prefix.strip_suffix('.') {
        Some(group) => {
            let members: Vec<&str> = keys
                .iter()
                .filter_map(|key| key.strip_prefix(prefix))
                .collect();
            (format!("{group}: "), format!(" ({})", members.join(", ")))
        }
        None => (String::new(), String::new()),
    };
    let entries = match mapping {
        Value::Mapping(entries) => entries,
        Value::Null => return Ok(()),
        other => {
            return Err(format!(
                "{group}must be a map of settings{members}, not {}",
                kind(other)
            ));
        }
    };
    for (name, value) in entries {
        if let Value::Sequence(_) | Value::Mapping(_) = untagged(name) {
            return Err(format!(
                "{group}a key is {}, not a setting's name ({KEYS_ARE})",
                kind(name)
            ));
        }
        let dotted = format!("{prefix}{}", yaml_scalar(name));
        if let Some(key) = keys.iter().find(|key| **key == dotted) {
            values.insert(key, value.clone());
        } else if keys
            .iter()
            .any(|key| key.starts_with(&format!("{dotted}.")))
        {
            collect(value, &format!("{dotted}."), keys, values)?;
        } else {
            return Err(format!("unknown key `{}` ({KEYS_ARE})", one_line(&dotted)));
        }
    }
    Ok(())
}

/// What the keys of the file are, for an error about one.
const KEYS_ARE: &str = "the keys are the long flag names, see --help";

fn untagged(value: &Value) -> &Value {
    match value {
        Value::Tagged(tagged) => untagged(&tagged.value),
        other => other,
    }
}

/// What a YAML value is, to say what was found where something else belongs.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a map",
        Value::Tagged(tagged) => kind(&tagged.value),
    }
}

/// A key as part of one line: a line break or other control character in it (a quoted key may
/// hold any) escaped, so the error is not cut there.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            c if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') => {
                c.escape_default().to_string()
            }
            c => c.to_string(),
        })
        .collect()
}

/// A YAML scalar as the text a flag would carry; a tag such as `!foo` is ignored.
pub(super) fn scalar_text(value: &Value) -> Result<String, String> {
    match value {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => Ok(yaml_scalar(value)),
        Value::Tagged(tagged) => scalar_text(&tagged.value),
        Value::Null | Value::Sequence(_) | Value::Mapping(_) => {
            Err("must be a string, number or boolean (use \"\" for empty)".to_owned())
        }
    }
}

/// A YAML scalar as the text a flag would carry, so the file is parsed like the flag.
pub(super) fn yaml_scalar(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => serde_yaml::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_known_version_is_taken_and_none_means_v1() {
        let keys = ["rescan-interval"];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        let read_text = |text: &str| {
            std::fs::write(&path, text).unwrap();
            read(&path, &keys).map(|document| document.values)
        };
        for text in [
            "rescan-interval: 2s\n",
            "version: v1\nrescan-interval: 2s\n",
        ] {
            let values = read_text(text).unwrap();
            assert_eq!(
                values.keys().collect::<Vec<_>>(),
                [&"rescan-interval"],
                "{text}"
            );
        }
        assert!(read_text("version:\n").unwrap().is_empty());
        let refused = |text: &str| read_text(text).unwrap_err().0;
        let unknown = refused("version: v2\nrescan-interval: 2s\n");
        assert!(
            unknown.ends_with(": version: unknown version \"v2\", this plugin reads v1"),
            "{unknown}"
        );
        for text in ["version: 1\n", "version: [v1]\n", "version: true\n"] {
            let wrong = refused(text);
            assert!(
                wrong.ends_with(": version: must be a string, one of v1"),
                "{wrong}"
            );
            assert!(wrong.contains(path.to_str().unwrap()), "{wrong}");
        }
    }

    #[test]
    fn a_deep_file_is_refused_before_parsing_whatever_its_quoting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deep.yaml");
        // A `'` or `#` inside a plain scalar in a flow collection starts no quote or comment,
        // and `\"` ends no quoted scalar: libyaml nests every bracket after them. 100,000 levels
        // took 38.5 s to refuse.
        for entry in ["a'", "a#b", "\"\\\"\""] {
            let levels = 100_000;
            let text = format!(
                "k: [{entry}, {}{}",
                "[".repeat(levels),
                "]".repeat(levels + 1)
            );
            std::fs::write(&path, &text).unwrap();
            let err = read(&path, &["k"]).err().unwrap().0;
            assert!(
                err.ends_with(&format!(
                    ": nested {} levels deep, more than the {CONFIG_DEPTH_LIMIT} allowed",
                    levels + 1
                )),
                "{entry}: {err}"
            );
        }
    }
}
