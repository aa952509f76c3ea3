//! `--allocate-env`: the environment every allocation gets, a repeatable `KEY=VALUE` flag, a
//! YAML or JSON map in its variable and a map under `allocate.env` in the file.

use std::collections::BTreeMap;

use clap::{Arg, ArgAction};
use serde::Serialize;
use serde_yaml::Value;

use super::depth::nesting_depth;
use super::file::{CONFIG_DEPTH_LIMIT, FileValues, scalar_text, yaml_scalar};
use super::origin::{ConfigError, Origin};
use super::setting::{Describe, Given, Resolve, flag_arg};

/// What every allocation gets besides its devices.
#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct AllocateSettings {
    /// Set in each container: through the Allocate answer with device-specs, through the CDI
    /// spec with cdi.
    pub env: BTreeMap<String, String>,
}

/// `--allocate-env`: repeatable on the command line, a map in the file.
pub(super) struct EnvSetting {
    pub(super) flag: &'static str,
    pub(super) env: &'static str,
    pub(super) value_name: &'static str,
    pub(super) file: &'static str,
}

impl Describe for EnvSetting {
    fn flag(&self) -> &'static str {
        self.flag
    }

    fn env(&self) -> &'static str {
        self.env
    }

    fn arg(&self) -> Arg {
        flag_arg(self.flag, self.env, self.value_name).action(ArgAction::Append)
    }

    fn file_key(&self) -> Option<&'static str> {
        Some(self.file)
    }

    fn default_text(&self) -> Option<&'static str> {
        None
    }

    fn is_path(&self) -> bool {
        false
    }

    fn file_schema(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "propertyNames": { "pattern": "^[A-Za-z_][A-Za-z0-9_]*$" },
            "additionalProperties": { "type": ["string", "number", "boolean"] },
        })
    }
}

impl Resolve<AllocateSettings> for EnvSetting {
    /// Each flag's one pair, or the variable's map, when given; else the file's map. Every
    /// entry is checked alike.
    fn resolve(&self, given: &Given) -> Result<(AllocateSettings, Origin), ConfigError> {
        if let Some((origin, texts)) = given.command_line(self) {
            let problem = |err: String| ConfigError(format!("{origin}: {err}"));
            let env = match origin {
                Origin::Env(_) => {
                    let text: String = texts.collect();
                    let map = env_map_text(&text).map_err(problem)?;
                    env_map(&map).map_err(|(key, err)| problem(format!("{key}: {err}")))?
                }
                _ => texts
                    .map(|text| parse_env_pair(&text))
                    .collect::<Result<_, _>>()
                    .map_err(problem)?,
            };
            return Ok((AllocateSettings { env }, origin));
        }
        let Some((path, value)) = given.file_value(self.file) else {
            return Ok((AllocateSettings::default(), Origin::Flag(self.flag)));
        };
        let at = |key: String| Origin::File(path.to_owned(), key);
        let env = env_map(value).map_err(|(key, err)| {
            ConfigError(format!("{}: {err}", at(format!("{}.{key}", self.file))))
        });
        match value {
            Value::Mapping(_) => Ok((AllocateSettings { env: env? }, at(self.file.to_owned()))),
            _ => Err(ConfigError(format!(
                "{}: must be a map of variables",
                at(self.file.to_owned())
            ))),
        }
    }
}

/// The variables of an `allocate.env` map (already holding each scalar's text, see
/// [`keep_scalar_text`]), or the key of the first bad entry and why.
fn env_map(value: &Value) -> Result<BTreeMap<String, String>, (String, String)> {
    let Value::Mapping(entries) = value else {
        return Ok(BTreeMap::new());
    };
    entries
        .iter()
        .map(|(key, value)| {
            let key = yaml_scalar(key);
            scalar_text(value)
                .map_err(|err| format!("the value of {key} {err}"))
                .and_then(|text| validate_env(&key, &text).map(|()| text))
                .map(|text| (key.clone(), text))
                .map_err(|err| (key, err))
        })
        .collect()
}

/// `EFA_DP_ALLOCATE_ENV`: a YAML (or JSON) map, as under `allocate.env` in the file. A map
/// cannot be mistaken: a value holds any commas and `=` it likes. Empty means no variables.
fn env_map_text(text: &str) -> Result<Value, String> {
    let usage = "must be a YAML or JSON map of variables, e.g. {\"FI_PROVIDER\": \"efa\", \"NCCL_SOCKET_IFNAME\": \"^lo,docker\"}";
    if nesting_depth(text) > CONFIG_DEPTH_LIMIT {
        return Err(format!(
            "{usage}, nested at most {CONFIG_DEPTH_LIMIT} levels"
        ));
    }
    let mut map: Value = serde_yaml::from_str(text)
        .map_err(|err| format!("{usage}: {}", err.to_string().replace('\n', " ")))?;
    match map {
        Value::Null => Ok(Value::Mapping(Default::default())),
        Value::Mapping(_) => {
            keep_scalar_text(&mut map, serde_yaml::from_str(text).ok());
            Ok(map)
        }
        _ => Err(usage.to_owned()),
    }
}

/// A YAML map of variables read as text: serde_yaml resolves a plain `1.10` to the float 1.1,
/// `0x10` to 16 and `True` to true in a [`Value`], but hands a string visitor the scalar as it
/// is written.
type ScalarTexts = BTreeMap<String, String>;

/// Gives each number or boolean in the map `map` the text it was written with, from `texts`
/// (absent when some entry is no scalar: that entry is refused anyway). The container gets
/// what the operator wrote, `1.10` and not `1.1`.
fn keep_scalar_text(map: &mut Value, texts: Option<ScalarTexts>) {
    let (Value::Mapping(entries), Some(texts)) = (map, texts) else {
        return;
    };
    for (key, value) in entries.iter_mut() {
        if matches!(value, Value::Number(_) | Value::Bool(_))
            && let Some(text) = texts.get(&yaml_scalar(key))
        {
            *value = Value::String(text.clone());
        }
    }
}

/// Only `allocate.env` of a config file (the `file` key of its [`EnvSetting`]), its values read
/// as text (see [`ScalarTexts`]).
#[derive(serde::Deserialize)]
struct FileEnv {
    allocate: Option<FileEnvGroup>,
}

#[derive(serde::Deserialize)]
struct FileEnvGroup {
    env: Option<ScalarTexts>,
}

/// Gives the numbers and booleans of the file's `allocate.env` (under `key`) in `values` the text
/// they were written with in the file's `text`.
pub(super) fn keep_file_text(values: &mut FileValues, key: &str, text: &str) {
    if let Some(env) = values.get_mut(key) {
        let texts = serde_yaml::from_str::<FileEnv>(text)
            .ok()
            .and_then(|file| file.allocate?.env);
        keep_scalar_text(env, texts);
    }
}

/// One `KEY=VALUE` pair, split at the first `=`: the value is kept whole, so
/// `NCCL_SOCKET_IFNAME=^lo,docker` and `OPTS=a=1,b=2` are one variable each.
fn parse_env_pair(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("invalid environment entry {text:?}: use KEY=VALUE"))?;
    validate_env(key, value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// What the runtime can set: a POSIX name, and a value that fits in a C string.
fn validate_env(key: &str, value: &str) -> Result<(), String> {
    if !is_env_name(key) {
        return Err(format!(
            "invalid environment variable name {key:?}: use letters, digits and '_', not starting with a digit"
        ));
    }
    if value.contains('\0') {
        return Err(format!(
            "invalid value for environment variable {key}: contains a NUL character"
        ));
    }
    Ok(())
}

fn is_env_name(key: &str) -> bool {
    let bytes = key.as_bytes();
    !bytes.is_empty()
        && !bytes[0].is_ascii_digit()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_pair_keeps_its_value_whole() {
        assert_eq!(
            parse_env_pair("OPTS=a=1,b=2"),
            Ok(("OPTS".to_owned(), "a=1,b=2".to_owned()))
        );
        assert_eq!(
            parse_env_pair("NCCL_SOCKET_IFNAME=^lo,docker"),
            Ok(("NCCL_SOCKET_IFNAME".to_owned(), "^lo,docker".to_owned()))
        );
        assert_eq!(
            parse_env_pair("EMPTY="),
            Ok(("EMPTY".to_owned(), String::new()))
        );
        assert!(parse_env_pair("NOVALUE").is_err());
        assert!(parse_env_pair("1X=y").is_err());
    }

    #[test]
    fn the_variables_map_is_refused_unless_it_is_one() {
        for text in ["A=1", "A=1,B=2", "[A, B]", "{A: [1]}", "{A: 1"] {
            let refused = env_map_text(text)
                .map_err(|err| (String::new(), err))
                .and_then(|map| env_map(&map));
            assert!(refused.is_err(), "{text}");
        }
        assert_eq!(env_map(&env_map_text("").unwrap()), Ok(BTreeMap::new()));
    }

    #[test]
    fn env_maps_keep_each_scalar_as_written() {
        let settings = crate::config::tests::from_file(
            "allocate:\n  env:\n    V: 1.10\n    H: 0x10\n    T: True\n    O: 010\n    I: 1\n    S: \"x,y\"\n",
        );
        let expected: BTreeMap<String, String> = [
            ("H", "0x10"),
            ("I", "1"),
            ("O", "010"),
            ("S", "x,y"),
            ("T", "True"),
            ("V", "1.10"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(settings.allocate.env, expected);
        let flow = env_map_text("{V: 1.10, H: 0x10, T: True, O: 010, I: 1, S: \"x,y\"}").unwrap();
        assert_eq!(env_map(&flow).unwrap(), expected);
    }
}
