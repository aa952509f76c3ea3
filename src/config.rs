//! Command line, environment and config file, merged into one validated [`Settings`].
//!
//! Precedence is flag, then `EFA_DP_<NAME>`, then the YAML file given by `--config`, then the
//! default. Every problem is reported as one line that names the flag, variable or file.
//!
//! Each setting is declared once, in the `settings!` table: its field, its help (the doc
//! comment) and a descriptor with its flag, variable, file key, default and the one parser that
//! reads its text, whichever source the text came from.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser};
use clap::parser::ValueSource;
use clap::{
    Arg, ArgAction, ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum,
};
use serde::Serialize;
use serde_yaml::Value;

use crate::allocation::sharing::{Sharing, parse_replicas};
use crate::discovery::DeviceIdStrategy;

#[derive(Parser, Debug)]
#[command(
    name = "efa-device-plugin",
    version,
    about = "Kubernetes device plugin for AWS Elastic Fabric Adapter (EFA)",
    // A later flag overrides an earlier one, so wrappers can append overrides to fixed args.
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Run the device plugin (the default).
    Run,
    /// Print the node's EFA devices as the plugin sees them.
    List {
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Run the plugin against a simulated p5.48xlarge and an in-process kubelet stand-in.
    #[cfg(feature = "demo")]
    Demo,
    /// Print the effective configuration (flags, environment and file merged) as YAML.
    Config,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(ValueEnum, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// How allocated devices reach the container runtime.
#[derive(ValueEnum, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceListStrategy {
    /// One DeviceSpec per uverbs node in the Allocate answer.
    #[default]
    DeviceSpecs,
    /// CDI device names in the Allocate answer; the nodes are in the plugin's CDI spec file.
    Cdi,
}

/// What every allocation gets besides its devices.
#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct AllocateSettings {
    /// Set in each container: through the Allocate answer with device-specs, through the CDI
    /// spec with cdi.
    pub env: BTreeMap<String, String>,
}

/// Declares [`Settings`] and, per field, the descriptor that reads it; the field's doc comment
/// is its `--help` text.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $(#[serde($($serde:tt)*)])?
        $field:ident: $ty:ty = $declared:expr;
    )+) => {
        /// The validated configuration the plugin runs with.
        #[derive(Serialize, Debug, Clone, PartialEq, Eq)]
        #[serde(rename_all = "kebab-case")]
        pub struct Settings {
            $( $(#[doc = $doc])+ $(#[serde($($serde)*)])? pub $field: $ty, )+
        }

        /// Each field's descriptor, typed by the field.
        struct Declared {
            $( $field: &'static dyn Resolve<$ty>, )+
        }

        const DECLARED: Declared = Declared { $( $field: &$declared, )+ };

        impl Declared {
            /// The descriptors in field order, each with its doc comment.
            fn each(&self) -> Vec<(&'static dyn Describe, &'static str)> {
                // Each doc line starts with its space, so the lines join into one paragraph.
                vec![$( (self.$field, concat!($($doc),+)), )+]
            }

            fn resolve(&self, given: &Given) -> Result<Settings, ConfigError> {
                Ok(Settings { $( $field: self.$field.resolve(given)?, )+ })
            }
        }
    };
}

settings! {
    /// Root of the sysfs tree to scan for EFA devices.
    sysfs_root: PathBuf = Setting::new("sysfs-root", "EFA_DP_SYSFS_ROOT", "DIR", "/sys", parse_path);
    /// Root of the device tree holding infiniband/uverbsN.
    dev_root: PathBuf = Setting::new("dev-root", "EFA_DP_DEV_ROOT", "DIR", "/dev", parse_path);
    /// Directory holding the kubelet's kubelet.sock; the plugin serves its socket there.
    device_plugin_dir: PathBuf = Setting::new("device-plugin-dir", "EFA_DP_DEVICE_PLUGIN_DIR",
        "DIR", "/var/lib/kubelet/device-plugins", parse_path);
    /// Extended resource name to advertise.
    resource_name: String = Setting::new("resource-name", "EFA_DP_RESOURCE_NAME", "NAME",
        "vpc.amazonaws.com/efa", parse_text);
    /// The ID each EFA is advertised by: ibdev (its name under class/infiniband, as the AWS
    /// plugin and CloudWatch know it) or pci (its PCI address).
    device_id_strategy: DeviceIdStrategy = Setting::choice("device-id-strategy",
        "EFA_DP_DEVICE_ID_STRATEGY", "DEVICE_ID_STRATEGY", "ibdev");
    /// Socket names, in the device-plugin dir, of other plugins for this resource (the AWS
    /// plugin's by default); while one accepts connections, this plugin does not take the
    /// resource back from it.
    competing_plugin_sockets: Vec<String> = Setting::list("competing-plugin-sockets",
        "EFA_DP_COMPETING_PLUGIN_SOCKETS", "NAME,...", "aws-efa-device-plugin.sock",
        parse_socket_names);
    /// How often to rescan sysfs (e.g. 500ms, 2s, 1m).
    #[serde(serialize_with = "serialize_duration")]
    rescan_interval: Duration = Setting::new("rescan-interval", "EFA_DP_RESCAN_INTERVAL",
        "DURATION", "5s", parse_interval);
    /// Log line format.
    log_format: LogFormat = Setting::choice("log-format", "EFA_DP_LOG_FORMAT", "LOG_FORMAT", "text");
    /// Log level or filter directives; RUST_LOG, when set, takes precedence.
    log_level: String = Setting::new("log-level", "EFA_DP_LOG_LEVEL", "LEVEL", "info", parse_text);
    /// Advertise each EFA as this many IDs, so that many containers can share it (1: no sharing).
    sharing: Sharing = Setting::new("sharing-replicas", "EFA_DP_SHARING_REPLICAS", "N", "1",
        parse_sharing)
        // Grouped in the file because more sharing knobs may follow.
        .in_file(FileKey::Named("sharing.replicas"));
    /// Address of the HTTP endpoint serving /metrics, /healthz and /readyz; empty disables it.
    #[serde(serialize_with = "serialize_optional")]
    metrics_address: Option<SocketAddr> = Setting::new("metrics-address",
        "EFA_DP_METRICS_ADDRESS", "ADDR", "0.0.0.0:9465", parse_metrics_address);
    /// The kubelet's PodResources socket, read to label EFA traffic with its pod (when present).
    pod_resources_socket: PathBuf = Setting::new("pod-resources-socket",
        "EFA_DP_POD_RESOURCES_SOCKET", "FILE", "/var/lib/kubelet/pod-resources/kubelet.sock",
        parse_path);
    /// The kubelet's plugin registration dir, where DRA drivers register.
    plugins_registry_dir: PathBuf = Setting::new("plugins-registry-dir",
        "EFA_DP_PLUGINS_REGISTRY_DIR", "DIR", "/var/lib/kubelet/plugins_registry", parse_path);
    /// DRA drivers that manage EFAs; while one is registered every device is withheld.
    dra_drivers: Vec<String> = Setting::list("dra-drivers", "EFA_DP_DRA_DRIVERS", "NAME,...",
        "dra.net", parse_driver_names);
    /// Keep advertising devices while an EFA DRA driver is registered on the node.
    allow_dra_coexistence: bool = Setting::switch("allow-dra-coexistence",
        "EFA_DP_ALLOW_DRA_COEXISTENCE", "false");
    /// Node-feature-discovery local feature file to keep current (e.g.
    /// /etc/kubernetes/node-feature-discovery/features.d/efa); empty disables it.
    #[serde(serialize_with = "serialize_optional_path")]
    nfd_features_file: Option<PathBuf> = Setting::new("nfd-features-file",
        "EFA_DP_NFD_FEATURES_FILE", "FILE", "", parse_optional_path);
    /// How Allocate hands devices to the runtime: device-specs (DeviceSpecs, every kubelet and
    /// runtime) or cdi (CDI names and a spec file; kubelet 1.28+ and a runtime with CDI on).
    device_list_strategy: DeviceListStrategy = Setting::choice("device-list-strategy",
        "EFA_DP_DEVICE_LIST_STRATEGY", "DEVICE_LIST_STRATEGY", "device-specs");
    /// Directory the runtime reads CDI specs from; the plugin writes its spec there in cdi mode.
    cdi_spec_dir: PathBuf = Setting::new("cdi-spec-dir", "EFA_DP_CDI_SPEC_DIR", "DIR",
        "/var/run/cdi", parse_path);
    /// Environment variable set in every container that gets an EFA; repeatable, each value
    /// kept whole, commas and '=' too. EFA_DP_ALLOCATE_ENV holds a YAML or JSON map instead,
    /// e.g. {"NCCL_SOCKET_IFNAME": "^lo,docker", "FI_PROVIDER": "efa"}.
    allocate: AllocateSettings = EnvSetting {
        flag: "allocate-env", env: "EFA_DP_ALLOCATE_ENV", value_name: "KEY=VALUE",
        file: "allocate.env",
    };
    /// Expose efa_device_allocation: the namespace, pod and container holding each device.
    counter_pod_labels: bool = Setting::switch("counter-pod-labels", "EFA_DP_COUNTER_POD_LABELS",
        "true");
    /// TEST ONLY: judge an empty regular file at a uverbs node path Healthy, for simulated nodes
    /// built without CAP_MKNOD. Never set it on a real node.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    test_only_regular_file_nodes: bool = Setting::switch("test-only-regular-file-nodes",
        "EFA_DP_TEST_ONLY_REGULAR_FILE_NODES", "false")
        // A test switch belongs on a test's command line, where it is seen; shown only when on.
        .in_file(FileKey::Never);
}

impl Default for Settings {
    /// The declared defaults, through the same parsers: no flag, variable or file is read.
    fn default() -> Self {
        DECLARED
            .resolve(&Given::default())
            .expect("every declared default parses")
    }
}

/// What `--help` and the file need to know of a setting, whatever its type.
trait Describe {
    fn flag(&self) -> &'static str;
    fn env(&self) -> &'static str;
    /// The flag's argument, without its help.
    fn arg(&self) -> Arg;
    /// The dotted key in the config file; `None` when the file may not set it.
    fn file_key(&self) -> Option<&'static str>;
}

trait Resolve<T>: Describe {
    /// The flag's or variable's value, else the file's, else the default.
    fn resolve(&self, given: &Given) -> Result<T, ConfigError>;
}

/// Where a setting sits in the config file.
#[derive(Clone, Copy)]
enum FileKey {
    /// Under the flag's name, as one scalar.
    Flag,
    /// Under another (dotted) key, as one scalar.
    Named(&'static str),
    /// Under the flag's name, as a YAML list: the items of the flag's comma-separated text.
    List,
    Never,
}

/// A setting with one value, given as text alike by its flag, its variable and the file.
struct Setting<T> {
    /// The long flag, also the clap id and, unless `file` says otherwise, the file key.
    flag: &'static str,
    env: &'static str,
    value_name: &'static str,
    /// Parsed like a given value, so `--help` shows what the plugin really uses.
    default: &'static str,
    parse: fn(&str) -> Result<T, String>,
    file: FileKey,
    /// A bare `--flag` means `--flag=true`.
    switch: bool,
    /// The words clap lists in `--help` and in its own error; empty for free text.
    choices: fn() -> Vec<PossibleValue>,
    /// For a repeatable flag: how the values of two occurrences combine, in order.
    repeat: Option<fn(T, T) -> T>,
}

impl<T> Setting<T> {
    /// A setting with one value, under the flag's name in the file.
    const fn new(
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
        }
    }

    const fn in_file(self, file: FileKey) -> Self {
        Setting { file, ..self }
    }
}

impl Setting<Vec<String>> {
    /// A list: comma-separated on the command line, where the flag may also be repeated, and a
    /// YAML list in the file.
    const fn list(
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
    const fn switch(flag: &'static str, env: &'static str, default: &'static str) -> Self {
        Setting {
            switch: true,
            ..Setting::new(flag, env, "BOOL", default, parse_bool)
        }
    }
}

impl<E: ValueEnum> Setting<E> {
    const fn choice(
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
            arg.value_parser(PossibleValuesParser::new(choices))
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
            FileKey::Never => None,
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Resolve<T> for Setting<T> {
    fn resolve(&self, given: &Given) -> Result<T, ConfigError> {
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
                return Ok(value);
            }
        }
        let Some((key, path, value)) = self.file_key().and_then(|key| {
            given
                .file_value(key)
                .map(|(path, value)| (key, path, value))
        }) else {
            return (self.parse)(self.default)
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
        text.and_then(|text| (self.parse)(&text))
            .map_err(|err| ConfigError(format!("{}: {err}", Origin::File(path, key))))
    }
}

/// `--allocate-env`: repeatable on the command line, a map in the file.
struct EnvSetting {
    flag: &'static str,
    env: &'static str,
    value_name: &'static str,
    file: &'static str,
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
}

impl Resolve<AllocateSettings> for EnvSetting {
    /// Each flag's one pair, or the variable's map, when given; else the file's map. Every
    /// entry is checked alike.
    fn resolve(&self, given: &Given) -> Result<AllocateSettings, ConfigError> {
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
            return Ok(AllocateSettings { env });
        }
        let Some((path, value)) = given.file_value(self.file) else {
            return Ok(AllocateSettings::default());
        };
        let env = env_map(value).map_err(|(key, err)| {
            let entry = format!("{}.{key}", self.file);
            ConfigError(format!("{}: {err}", Origin::File(path, &entry)))
        });
        match value {
            Value::Mapping(_) => Ok(AllocateSettings { env: env? }),
            _ => Err(ConfigError(format!(
                "{}: must be a map of variables",
                Origin::File(path, self.file)
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

/// What the settings are read from: nothing at all for [`Settings::default`].
#[derive(Default)]
struct Given<'a> {
    matches: Option<&'a ArgMatches>,
    file: Option<(&'a Path, FileValues)>,
}

impl Given<'_> {
    /// A flag's or variable's texts (one per occurrence of a repeatable flag), and which of
    /// the two gave them.
    fn command_line<'s>(
        &'s self,
        setting: &'s dyn Describe,
    ) -> Option<(Origin<'s>, impl Iterator<Item = String> + 's)> {
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
    fn file_value(&self, key: &str) -> Option<(&Path, &Value)> {
        let (path, values) = self.file.as_ref()?;
        values
            .get(key)
            .filter(|value| !value.is_null())
            .map(|value| (*path, value))
    }

    /// Where a setting's value came from, for a check made after merging.
    fn origin<'s>(&'s self, setting: &'s dyn Describe) -> Origin<'s> {
        let source = self.matches.and_then(|m| m.value_source(setting.flag()));
        match (source, &self.file) {
            (Some(ValueSource::EnvVariable), _) => Origin::Env(setting.env()),
            (Some(ValueSource::DefaultValue) | None, Some((path, _))) => {
                Origin::File(path, setting.flag())
            }
            _ => Origin::Flag(setting.flag()),
        }
    }
}

/// The doc comment as clap's derive shows it, without the closing period.
fn help_text(doc: &str) -> String {
    let doc = doc.trim();
    doc.strip_suffix('.').unwrap_or(doc).to_owned()
}

/// The part every flag shares: a long name, its variable and its value's name in `--help`;
/// global, so it may follow the subcommand.
fn flag_arg(flag: &'static str, env: &'static str, value_name: &'static str) -> Arg {
    Arg::new(flag)
        .long(flag)
        .env(env)
        .value_name(value_name)
        .global(true)
}

fn cli() -> clap::Command {
    let config = flag_arg(CONFIG.0, CONFIG.1, "FILE")
        .help("YAML file with any of these options, keyed by their long names");
    let settings = DECLARED
        .each()
        .into_iter()
        .map(|(setting, doc)| setting.arg().help(help_text(doc)));
    Cli::command().arg(config).args(settings)
}

/// Parses the command line (and environment, and config file) into a command and its settings.
pub fn parse<I, T>(args: I) -> Result<(Command, Settings), clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = cli().try_get_matches_from(args)?;
    let command = Cli::from_arg_matches(&matches)?
        .command
        .unwrap_or(Command::Run);
    let settings = settings_from(&matches)
        .map_err(|err| cli().error(clap::error::ErrorKind::ValueValidation, err.0))?;
    Ok((command, settings))
}

/// The `--config` flag and its variable.
const CONFIG: (&str, &str) = ("config", "EFA_DP_CONFIG");

fn settings_from(matches: &ArgMatches) -> Result<Settings, ConfigError> {
    let config = match matches.get_one::<String>(CONFIG.0) {
        Some(text) => {
            let origin = match matches.value_source(CONFIG.0) {
                Some(ValueSource::EnvVariable) => Origin::Env(CONFIG.1),
                _ => Origin::Flag(CONFIG.0),
            };
            Some(parse_path(text).map_err(|err| ConfigError(format!("{origin}: {err}")))?)
        }
        None => None,
    };
    let file = match &config {
        Some(path) => Some((path.as_path(), read_file(path)?)),
        None => None,
    };
    let given = Given {
        matches: Some(matches),
        file,
    };
    let settings = DECLARED.resolve(&given)?;
    let origin = given.origin(DECLARED.resource_name);
    validate_resource_name(&settings.resource_name)
        .map_err(|err| ConfigError(format!("{origin}: {err}")))?;
    if settings.device_list_strategy == DeviceListStrategy::Cdi {
        crate::cdi::Kind::of(&settings.resource_name).map_err(|err| {
            ConfigError(format!(
                "{origin}: {err} (needed by --device-list-strategy=cdi)"
            ))
        })?;
    }
    Ok(settings)
}

/// A path that must be given: an empty one would resolve against the working directory
/// (`--cdi-spec-dir ''` wrote the spec there) or never work (`--device-plugin-dir ''`).
fn parse_path(text: &str) -> Result<PathBuf, String> {
    if text.trim().is_empty() {
        return Err("must not be empty: give a path".to_owned());
    }
    Ok(PathBuf::from(text))
}

fn parse_text(text: &str) -> Result<String, String> {
    Ok(text.to_owned())
}

fn parse_sharing(text: &str) -> Result<Sharing, String> {
    parse_replicas(text).map(Sharing::replicas)
}

fn choices<E: ValueEnum>() -> Vec<PossibleValue> {
    E::value_variants()
        .iter()
        .filter_map(ValueEnum::to_possible_value)
        .collect()
}

/// One of an enum's words, e.g. `text` or `json`.
fn parse_choice<E: ValueEnum>(text: &str) -> Result<E, String> {
    E::from_str(text, false).map_err(|_| {
        let choices = choices::<E>();
        let names: Vec<&str> = choices.iter().map(PossibleValue::get_name).collect();
        format!("invalid value {text:?}: use {}", names.join(" or "))
    })
}
/// Writes a disabled option as the empty string that disables it on the command line.
fn serialize_optional<T: fmt::Display, S: serde::Serializer>(
    value: &Option<T>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => s.collect_str(value),
        None => s.serialize_str(""),
    }
}

fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

fn serialize_optional_path<S: serde::Serializer>(
    value: &Option<PathBuf>,
    s: S,
) -> Result<S::Ok, S::Error> {
    serialize_optional(&value.as_deref().map(Path::display), s)
}

/// A configuration problem, already phrased as the one line the user sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The shortest rescan interval: a full pass over a 256-EFA node takes a few milliseconds, so
/// anything shorter would keep a core busy rescanning.
pub(crate) const MIN_RESCAN_INTERVAL: Duration = Duration::from_millis(100);

/// The longest rescan interval. It is also the pause before a failed file write is retried
/// and a changed one healed, and the DRA guard's fallback look: an hour is already late for
/// each. Far longer ones overflow the runtime's clock (`200000000000y` panicked at the first
/// probe).
pub(crate) const MAX_RESCAN_INTERVAL: Duration = Duration::from_secs(3600);

/// Parses a duration such as `500ms` or `2s`; below [`MIN_RESCAN_INTERVAL`] is refused because
/// it would spin, above [`MAX_RESCAN_INTERVAL`] because nothing would be noticed.
pub(crate) fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|err| format!("invalid duration {text:?}: {err} (use e.g. 500ms, 2s, 1m)"))?;
    let bound = |what: &str, limit: Duration| {
        Err(format!(
            "invalid duration {text:?}: must be at {what} {}",
            humantime::format_duration(limit)
        ))
    };
    if d < MIN_RESCAN_INTERVAL {
        return bound("least", MIN_RESCAN_INTERVAL);
    }
    if d > MAX_RESCAN_INTERVAL {
        return bound("most", MAX_RESCAN_INTERVAL);
    }
    Ok(d)
}

/// `host:port`, or empty for no endpoint. Only an IP literal: resolving a name would make start-up
/// depend on DNS.
pub(crate) fn parse_metrics_address(text: &str) -> Result<Option<SocketAddr>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| {
        format!("invalid address {text:?}: use IP:PORT, e.g. 0.0.0.0:9465, or \"\" to disable")
    })
}

/// Comma-separated driver names, e.g. `dra.net,efa.example.com`.
pub(crate) fn parse_driver_names(text: &str) -> Result<Vec<String>, String> {
    let names = comma_list(text);
    match names.iter().find(|name| name.contains('/')) {
        Some(name) => Err(format!(
            "invalid driver name {name:?}: must not contain '/'"
        )),
        None => Ok(names),
    }
}

/// The non-empty, trimmed items of a comma-separated list.
fn comma_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Comma-separated file names inside the device-plugin dir, e.g. `aws-efa-device-plugin.sock`.
pub(crate) fn parse_socket_names(text: &str) -> Result<Vec<String>, String> {
    let names = comma_list(text);
    match names
        .iter()
        .find(|name| name.contains('/') || *name == "." || *name == "..")
    {
        Some(name) => Err(format!(
            "invalid socket name {name:?}: a file name in the device-plugin dir, without '/'"
        )),
        None => Ok(names),
    }
}

pub(crate) fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("invalid value {text:?}: use true or false")),
    }
}

/// One `KEY=VALUE` pair, split at the first `=`: the value is kept whole, so
/// `NCCL_SOCKET_IFNAME=^lo,docker` and `OPTS=a=1,b=2` are one variable each.
pub(crate) fn parse_env_pair(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("invalid environment entry {text:?}: use KEY=VALUE"))?;
    validate_env(key, value)?;
    Ok((key.to_owned(), value.to_owned()))
}

/// What the runtime can set: a POSIX name, and a value that fits in a C string.
pub(crate) fn validate_env(key: &str, value: &str) -> Result<(), String> {
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

fn parse_optional_path(text: &str) -> Result<Option<PathBuf>, String> {
    Ok(Some(text.trim())
        .filter(|t| !t.is_empty())
        .map(PathBuf::from))
}

/// The kubelet's `IsExtendedResourceName`: `<dns-subdomain>/<name>`, outside `kubernetes.io`,
/// and `requests.<name>` must still be a qualified name.
pub(crate) fn validate_resource_name(name: &str) -> Result<(), String> {
    let invalid = |why: &str| Err(format!("invalid extended resource name {name:?}: {why}"));
    let Some((prefix, base)) = name.split_once('/') else {
        return invalid("must contain '/', e.g. vpc.amazonaws.com/efa");
    };
    if name.contains("kubernetes.io/") {
        return invalid("the kubernetes.io domain is reserved for native resources");
    }
    if name.starts_with("requests.") {
        return invalid("must not start with \"requests.\"");
    }
    if !is_dns_subdomain(&format!("requests.{prefix}")) {
        return invalid("the part before '/' must be a DNS subdomain");
    }
    if !is_qualified_name_part(base) {
        return invalid(
            "the part after '/' must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric",
        );
    }
    Ok(())
}

fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253
        && text.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes.len() <= 63
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes[0].is_ascii_alphanumeric()
                && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        })
}

fn is_qualified_name_part(text: &str) -> bool {
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

/// Where a setting's value came from, to name it in an error.
enum Origin<'a> {
    Flag(&'a str),
    Env(&'a str),
    File(&'a Path, &'a str),
}

impl fmt::Display for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(flag) => write!(f, "--{flag}"),
            Origin::Env(var) => write!(f, "{var}"),
            Origin::File(path, key) => write!(f, "config file {}: {key}", path.display()),
        }
    }
}

/// A config file is a few hundred bytes; the cap keeps a wrong path (a log, a disk image) from
/// being read whole.
pub(crate) const CONFIG_SIZE_LIMIT: u64 = 1 << 20;
/// The schema nests two levels; the YAML parser's cost grows with the square of the depth, so
/// deeper input is refused before it is parsed.
pub(crate) const CONFIG_DEPTH_LIMIT: usize = 32;

/// The config file's values by their dotted key, e.g. `sharing.replicas`.
type FileValues = BTreeMap<&'static str, Value>;

/// Reads the file given by `--config` into its values by dotted key.
fn read_file(path: &Path) -> Result<FileValues, ConfigError> {
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
    let document: Value =
        serde_yaml::from_str(&text).map_err(|err| problem(err.to_string().replace('\n', " ")))?;
    // An empty file, or one of comments only, is an empty document: the defaults.
    if document.is_null() {
        return Ok(values);
    }
    let keys: Vec<&'static str> = DECLARED
        .each()
        .into_iter()
        .filter_map(|(setting, _)| setting.file_key())
        .collect();
    collect(&document, "", &keys, &mut values).map_err(problem)?;
    if let Some(env) = DECLARED
        .allocate
        .file_key()
        .and_then(|key| values.get_mut(key))
    {
        let texts = serde_yaml::from_str::<FileEnv>(&text)
            .ok()
            .and_then(|file| file.allocate?.env);
        keep_scalar_text(env, texts);
    }
    Ok(values)
}

/// Files the entries of one mapping, the document or a group such as `sharing:`, under their
/// dotted keys. An unknown key is an error, so a typo cannot silently fall back to a default.
fn collect(
    mapping: &Value,
    prefix: &str,
    keys: &[&'static str],
    values: &mut FileValues,
) -> Result<(), String> {
    let Value::Mapping(entries) = mapping else {
        return Err(format!("{prefix}expected a map of settings"));
    };
    for (name, value) in entries {
        let dotted = format!("{prefix}{}", yaml_scalar(name));
        if let Some(key) = keys.iter().find(|key| **key == dotted) {
            values.insert(key, value.clone());
        } else if keys
            .iter()
            .any(|key| key.starts_with(&format!("{dotted}.")))
        {
            collect(value, &format!("{dotted}."), keys, values)?;
        } else {
            return Err(format!(
                "unknown key `{dotted}` (the keys are the long flag names, see --help)"
            ));
        }
    }
    Ok(())
}

/// A YAML scalar as the text a flag would carry; a tag such as `!foo` is ignored.
fn scalar_text(value: &Value) -> Result<String, String> {
    match value {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => Ok(yaml_scalar(value)),
        Value::Tagged(tagged) => scalar_text(&tagged.value),
        Value::Null | Value::Sequence(_) | Value::Mapping(_) => {
            Err("must be a string, number or boolean (use \"\" for empty)".to_owned())
        }
    }
}

/// An upper bound on how deep the YAML in `text` nests, found without parsing it: per line, its
/// indentation (two columns a level), its leading `- ` and `? ` entries, and the `[`/`{` flow
/// collections open at its end. It may overcount (brackets in a plain scalar), never
/// undercount, which is the safe side for a limit far above what the schema needs.
fn nesting_depth(text: &str) -> usize {
    let mut flow: usize = 0;
    let mut deepest = 0;
    for line in text.lines() {
        let indent = line.len() - line.trim_start_matches([' ', '\t']).len();
        let mut rest = line.trim_start();
        let mut entries = 0;
        while let Some(after) = rest.strip_prefix("- ").or_else(|| rest.strip_prefix("? ")) {
            entries += 1;
            rest = after.trim_start();
        }
        let mut quote = None;
        for c in rest.chars() {
            match (quote, c) {
                (None, '#') => break,
                (None, '\'' | '"') => quote = Some(c),
                (Some(open), c) if c == open => quote = None,
                (None, '[' | '{') => flow += 1,
                (None, ']' | '}') => flow = flow.saturating_sub(1),
                _ => {}
            }
            deepest = deepest.max(flow);
        }
        deepest = deepest.max(indent.div_ceil(2) + entries + flow);
    }
    deepest
}

/// A YAML scalar as the text a flag would carry, so the file is parsed like the flag.
fn yaml_scalar(value: &serde_yaml::Value) -> String {
    match value {
        serde_yaml::Value::String(text) => text.clone(),
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
    fn resource_names_follow_the_kubelet() {
        for good in [
            "vpc.amazonaws.com/efa",
            "example.com/efa_shared",
            "a.b/c.d-e",
        ] {
            assert_eq!(validate_resource_name(good), Ok(()), "{good}");
        }
        let long = format!("example.com/{}", "x".repeat(64));
        for bad in [
            "efa",
            "kubernetes.io/efa",
            "node.kubernetes.io/efa",
            "requests.example.com/efa",
            "Example.com/efa",
            "example.com/",
            "/efa",
            "example.com/efa-",
            "exa_mple.com/efa",
            long.as_str(),
        ] {
            assert!(validate_resource_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn intervals_parse_like_the_docs_say() {
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_interval("0s").is_err());
        assert!(parse_interval("1ns").is_err());
        assert!(parse_interval("99ms").is_err());
        assert_eq!(parse_interval("100ms"), Ok(MIN_RESCAN_INTERVAL));
        assert!(parse_interval("fast").is_err());
        assert!(parse_interval("").is_err());
        assert_eq!(parse_interval("1h"), Ok(MAX_RESCAN_INTERVAL));
        for huge in ["61m", "200000000000y", "500000000000y"] {
            let err = parse_interval(huge).unwrap_err();
            assert!(err.contains("at most 1h"), "{huge}: {err}");
        }
    }

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
    fn env_maps_keep_each_scalar_as_written() {
        let settings = from_file(
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
    fn nesting_depth_bounds_block_compact_and_flow_nesting() {
        assert_eq!(nesting_depth("sharing:\n  replicas: 1\n"), 1);
        assert_eq!(nesting_depth("dra-drivers:\n  - dra.net\n"), 2);
        assert_eq!(nesting_depth("a: [[[1]]]\n"), 3);
        assert_eq!(nesting_depth("a: \"[[[\" # [[[\n"), 0);
        assert_eq!(nesting_depth(&"- ".repeat(50)), 50);
        assert_eq!(
            nesting_depth(&format!("{}\n{}", "[".repeat(40), "]".repeat(40))),
            40
        );
    }

    /// The settings a config file holding `text` gives.
    fn from_file(text: &str) -> Settings {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, text).unwrap();
        let args = [
            "efa-device-plugin",
            "--config",
            path.to_str().unwrap(),
            "config",
        ];
        parse(args).unwrap().1
    }

    #[test]
    fn an_empty_or_comments_only_config_file_means_defaults() {
        for text in [
            "",
            "\n",
            "# efa-device-plugin settings\n# rescan-interval: 2s\n",
        ] {
            assert_eq!(from_file(text), Settings::default(), "{text:?}");
        }
    }

    #[test]
    fn defaults_ignore_efa_dp_variables() {
        const NAME: &str = "config::tests::defaults_ignore_efa_dp_variables";
        if std::env::var_os("EFA_DP_RESCAN_INTERVAL").is_some() {
            // In the child below: the variables are set, yet the declared defaults stand.
            let settings = Settings::default();
            assert_eq!(settings.rescan_interval, Duration::from_secs(5));
            assert_eq!(settings.resource_name, "vpc.amazonaws.com/efa");
            return;
        }
        // Setting a variable in this process is unsafe (and denied), so a child gets them.
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--test-threads=1"])
            .env("EFA_DP_RESCAN_INTERVAL", "2s")
            .env("EFA_DP_RESOURCE_NAME", "example.com/from-env")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(child.status.success(), "{stdout}");
        assert!(
            stdout.contains("1 passed"),
            "the child ran no test: {stdout}"
        );
    }

    #[test]
    fn variables_are_efa_dp_and_the_flag_name() {
        for (setting, _) in DECLARED.each() {
            let expected = format!("EFA_DP_{}", setting.flag().to_uppercase().replace('-', "_"));
            assert_eq!(setting.env(), expected);
        }
    }

    #[test]
    fn unknown_keys_are_named_with_their_group() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("typo.yaml");
        for (text, named) in [
            ("sharing:\n  replica: 2\n", "unknown key `sharing.replica`"),
            ("sharing: 2\n", "sharing.expected a map of settings"),
            ("rescan-interval: 1s\nrescan-interval: 2s\n", "duplicate"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = read_file(&path).unwrap_err().0;
            assert!(err.contains(named), "{text:?}: {err}");
        }
    }
}
