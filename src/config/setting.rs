//! One row of the settings table: what a setting is called on the command line, in the
//! environment and in the file, and how its text from each becomes its value.

use std::path::Path;

use clap::builder::{PossibleValue, StringValueParser, TypedValueParser};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, ValueEnum};
use serde_yaml::Value;

use super::file::{FileValues, scalar_text};
use super::origin::{ConfigError, Origin};
use super::parsers::{choices, parse_bool, parse_choice};

/// What `--help` and the file need to know of a setting, whatever its type.
pub(super) trait Describe {
    fn flag(&self) -> &'static str;
    fn env(&self) -> &'static str;
    /// The flag's argument, without its help.
    fn arg(&self) -> Arg;
    /// The dotted key in the config file; `None` when the file may not set it.
    fn file_key(&self) -> Option<&'static str>;
    /// The JSON schema of its value in the config file.
    fn file_schema(&self) -> serde_json::Value;
    /// The text parsed when nothing gives the setting; `None` when nothing means empty.
    fn default_text(&self) -> Option<&'static str>;
    /// Whether the value names a file or directory, which a deployment must mount.
    fn is_path(&self) -> bool;
}

pub(super) trait Resolve<T>: Describe {
    /// The flag's or variable's value, else the file's, else the default; and where it came
    /// from.
    fn resolve(&self, given: &Given) -> Result<(T, Origin), ConfigError>;
}

/// Where a setting sits in the config file.
#[derive(Clone, Copy)]
pub(super) enum FileKey {
    /// Under the flag's name, as one scalar.
    Flag,
    /// Under another (dotted) key, as one scalar.
    Named(&'static str),
    /// Under the flag's name, as a YAML list: the items of the flag's comma-separated text.
    List,
    /// Not in the file: only the test switch, which a test build alone has.
    #[cfg(feature = "testkit")]
    Never,
}

/// A setting with one value, given as text alike by its flag, its variable and the file.
pub(super) struct Setting<T> {
    /// The long flag, also the clap id and, unless `file` says otherwise, the file key.
    flag: &'static str,
    env: &'static str,
    value_name: &'static str,
    /// Parsed like a given value, so `--help` shows what the plugin really uses.
    default: &'static str,
    parse: fn(&str) -> Result<T, String>,
    pub(super) file: FileKey,
    /// A bare `--flag` means `--flag=true`.
    switch: bool,
    /// The words `--help` lists; empty for free text.
    choices: fn() -> Vec<PossibleValue>,
    /// For a repeatable flag: how the values of two occurrences combine, in order.
    repeat: Option<fn(T, T) -> T>,
    path: bool,
}

impl<T> Setting<T> {
    /// A setting with one value, under the flag's name in the file.
    pub(super) const fn new(
        flag: &'static str,
        env: &'static str,
        value_name: &'static str,
        default: &'static str,
        parse: fn(&str) -> Result<T, String>,
    ) -> Self {
        Setting {
            flag,
            env,
            value_name,
            default,
            parse,
            file: FileKey::Flag,
            switch: false,
            choices: Vec::new,
            repeat: None,
            path: false,
        }
    }

    /// The value names a file or directory, which a deployment must mount.
    pub(super) const fn naming_a_path(self) -> Self {
        Setting { path: true, ..self }
    }

    pub(super) const fn in_file(self, file: FileKey) -> Self {
        Setting { file, ..self }
    }
}

impl Setting<Vec<String>> {
    /// A list: comma-separated on the command line, where the flag may also be repeated, and a
    /// YAML list in the file.
    pub(super) const fn list(
        flag: &'static str,
        env: &'static str,
        value_name: &'static str,
        default: &'static str,
        parse: fn(&str) -> Result<Vec<String>, String>,
    ) -> Self {
        Setting {
            repeat: Some(concat_lists),
            ..Setting::new(flag, env, value_name, default, parse).in_file(FileKey::List)
        }
    }
}

fn concat_lists(mut first: Vec<String>, second: Vec<String>) -> Vec<String> {
    first.extend(second);
    first
}

impl Setting<bool> {
    pub(super) const fn switch(
        flag: &'static str,
        env: &'static str,
        default: &'static str,
    ) -> Self {
        Setting {
            switch: true,
            ..Setting::new(flag, env, "BOOL", default, parse_bool)
        }
    }
}

impl<E: ValueEnum> Setting<E> {
    pub(super) const fn choice(
        flag: &'static str,
        env: &'static str,
        value_name: &'static str,
        default: &'static str,
    ) -> Self {
        Setting {
            choices: choices::<E>,
            ..Setting::new(flag, env, value_name, default, parse_choice::<E>)
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Describe for Setting<T> {
    fn flag(&self) -> &'static str {
        self.flag
    }

    fn env(&self) -> &'static str {
        self.env
    }

    /// The text is parsed in [`Resolve::resolve`], which knows whether the flag or the
    /// variable gave it and names that one in an error.
    fn arg(&self) -> Arg {
        let arg = flag_arg(self.flag, self.env, self.value_name).default_value(self.default);
        let choices = (self.choices)();
        let arg = if choices.is_empty() {
            arg
        } else {
            arg.value_parser(ChoiceText(choices))
        };
        if self.switch {
            arg.num_args(0..=1).default_missing_value("true")
        } else if self.repeat.is_some() {
            arg.action(ArgAction::Append)
        } else {
            arg
        }
    }

    fn file_key(&self) -> Option<&'static str> {
        match self.file {
            FileKey::Flag | FileKey::List => Some(self.flag),
            FileKey::Named(key) => Some(key),
            #[cfg(feature = "testkit")]
            FileKey::Never => None,
        }
    }

    fn default_text(&self) -> Option<&'static str> {
        Some(self.default).filter(|text| !text.is_empty())
    }

    fn is_path(&self) -> bool {
        self.path
    }

    /// By the value's name in `--help`, which says what the text is: a switch, one of the
    /// choices, a list of the flag's comma-separated items, a count, or text.
    fn file_schema(&self) -> serde_json::Value {
        let choices = (self.choices)();
        if !choices.is_empty() {
            let names: Vec<&str> = choices.iter().map(PossibleValue::get_name).collect();
            return serde_json::json!({ "enum": names });
        }
        match (self.file, self.value_name) {
            (FileKey::List, _) => {
                serde_json::json!({ "type": "array", "items": { "type": "string" } })
            }
            (_, "BOOL") => serde_json::json!({ "type": "boolean" }),
            (_, "N") => serde_json::json!({ "type": "integer", "minimum": 1 }),
            _ => serde_json::json!({ "type": "string" }),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Resolve<T> for Setting<T> {
    fn resolve(&self, given: &Given) -> Result<(T, Origin), ConfigError> {
        if let Some((origin, texts)) = given.command_line(self) {
            let mut given_value = None;
            for text in texts {
                let value =
                    (self.parse)(&text).map_err(|err| ConfigError(format!("{origin}: {err}")))?;
                given_value = Some(match (given_value, self.repeat) {
                    (Some(earlier), Some(combine)) => combine(earlier, value),
                    _ => value,
                });
            }
            if let Some(value) = given_value {
                return Ok((value, origin));
            }
        }
        let Some((key, path, value)) = self.file_key().and_then(|key| {
            given
                .file_value(key)
                .map(|(path, value)| (key, path, value))
        }) else {
            return (self.parse)(self.default)
                .map(|value| (value, Origin::Flag(self.flag)))
                .map_err(|err| ConfigError(format!("default of --{}: {err}", self.flag)));
        };
        let text = match (self.file, value) {
            (FileKey::List, Value::Sequence(items)) => items
                .iter()
                .map(scalar_text)
                .collect::<Result<Vec<_>, _>>()
                .map(|items| items.join(",")),
            (FileKey::List, _) => Err("must be a list".to_owned()),
            _ => scalar_text(value),
        };
        let origin = Origin::File(path.to_owned(), key.to_owned());
        text.and_then(|text| (self.parse)(&text))
            .map(|value| (value, origin.clone()))
            .map_err(|err| ConfigError(format!("{origin}: {err}")))
    }
}

/// A choice's text as given, with the choices for `--help` to list. clap does not judge the
/// text: its error would name the flag even when the variable gave the value, so the setting's
/// own parser does, naming whichever did.
#[derive(Clone)]
struct ChoiceText(Vec<PossibleValue>);

impl TypedValueParser for ChoiceText {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        StringValueParser::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(self.0.iter().cloned()))
    }
}

/// What the settings are read from: nothing at all for the declared defaults.
#[derive(Default)]
pub(super) struct Given<'a> {
    pub(super) matches: Option<&'a ArgMatches>,
    pub(super) file: Option<(&'a Path, FileValues)>,
}

impl Given<'_> {
    /// A flag's or variable's texts (one per occurrence of a repeatable flag), and which of
    /// the two gave them.
    pub(super) fn command_line<'s>(
        &'s self,
        setting: &'s dyn Describe,
    ) -> Option<(Origin, impl Iterator<Item = String> + 's)> {
        let matches = self.matches?;
        let origin = match matches.value_source(setting.flag())? {
            ValueSource::DefaultValue => return None,
            ValueSource::EnvVariable => Origin::Env(setting.env()),
            _ => Origin::Flag(setting.flag()),
        };
        let texts = matches.get_many::<String>(setting.flag())?.cloned();
        Some((origin, texts))
    }

    /// A null in the file, as in `key:` alone, leaves the setting unset.
    pub(super) fn file_value(&self, key: &str) -> Option<(&Path, &Value)> {
        let (path, values) = self.file.as_ref()?;
        values
            .get(key)
            .filter(|value| !value.is_null())
            .map(|value| (*path, value))
    }
}

/// The doc comment as clap's derive shows it, without the closing period.
pub(super) fn help_text(doc: &str) -> String {
    let doc = doc.trim();
    doc.strip_suffix('.').unwrap_or(doc).to_owned()
}

/// The part every flag shares: a long name, its variable and its value's name in `--help`;
/// global, so it may follow the subcommand.
pub(super) fn flag_arg(flag: &'static str, env: &'static str, value_name: &'static str) -> Arg {
    Arg::new(flag)
        .long(flag)
        .env(env)
        .value_name(value_name)
        .global(true)
}

/// A flag that is no setting: it is read before the settings, and only from the command line
/// or its variable.
pub(super) struct PlainFlag {
    pub flag: &'static str,
    pub env: &'static str,
    pub value_name: &'static str,
    pub help: &'static str,
}

/// `--config`, which names the file the settings may come from.
pub(super) const CONFIG: PlainFlag = PlainFlag {
    flag: "config",
    env: "EFA_DP_CONFIG",
    value_name: "FILE",
    help: "YAML file with any of these options, keyed by their long names",
};
