//! Command line, environment and config file, merged into one validated [`Settings`].
//!
//! Precedence is flag, then `EFA_DP_<NAME>`, then the YAML file given by `--config`, then the
//! default. Every problem is reported as one line that names the flag, variable or file.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::allocation::sharing::{Sharing, parse_replicas};

#[derive(Parser, Debug)]
#[command(
    name = "efa-device-plugin",
    version,
    about = "Kubernetes device plugin for AWS Elastic Fabric Adapter (EFA)",
    // A later flag overrides an earlier one, so wrappers can append overrides to fixed args.
    args_override_self = true
)]
pub struct Cli {
    #[command(flatten)]
    pub options: Options,
    #[command(subcommand)]
    pub command: Option<Command>,
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

#[derive(ValueEnum, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug)]
pub struct Options {
    /// Root of the sysfs tree to scan for EFA devices.
    #[arg(
        long,
        env = "EFA_DP_SYSFS_ROOT",
        default_value = "/sys",
        value_name = "DIR",
        global = true
    )]
    pub sysfs_root: PathBuf,
    /// Root of the device tree holding infiniband/uverbsN.
    #[arg(
        long,
        env = "EFA_DP_DEV_ROOT",
        default_value = "/dev",
        value_name = "DIR",
        global = true
    )]
    pub dev_root: PathBuf,
    /// Directory holding the kubelet's kubelet.sock; the plugin serves its socket there.
    #[arg(
        long,
        env = "EFA_DP_DEVICE_PLUGIN_DIR",
        default_value = "/var/lib/kubelet/device-plugins",
        value_name = "DIR",
        global = true
    )]
    pub device_plugin_dir: PathBuf,
    /// Extended resource name to advertise.
    #[arg(
        long,
        env = "EFA_DP_RESOURCE_NAME",
        default_value = "vpc.amazonaws.com/efa",
        value_name = "NAME",
        global = true
    )]
    pub resource_name: String,
    /// How often to rescan sysfs (e.g. 500ms, 2s, 1m).
    #[arg(
        long,
        env = "EFA_DP_RESCAN_INTERVAL",
        default_value = "5s",
        value_name = "DURATION",
        value_parser = parse_interval,
        global = true
    )]
    pub rescan_interval: Duration,
    /// YAML file with any of these options, keyed by their long names.
    #[arg(long, env = "EFA_DP_CONFIG", value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,
    /// Log line format.
    #[arg(
        long,
        env = "EFA_DP_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// Log level or filter directives; RUST_LOG, when set, takes precedence.
    #[arg(
        long,
        env = "EFA_DP_LOG_LEVEL",
        default_value = "info",
        value_name = "LEVEL",
        global = true
    )]
    pub log_level: String,
    /// Advertise each EFA as this many IDs, so that many containers can share it (1: no sharing).
    #[arg(
        long,
        env = "EFA_DP_SHARING_REPLICAS",
        default_value = "1",
        value_name = "N",
        value_parser = parse_replicas,
        global = true
    )]
    pub sharing_replicas: std::num::NonZeroU32,
    /// Address of the HTTP endpoint serving /metrics, /healthz and /readyz; empty disables it.
    #[arg(
        long,
        env = "EFA_DP_METRICS_ADDRESS",
        default_value = "0.0.0.0:9465",
        value_name = "ADDR",
        value_parser = parse_metrics_address,
        global = true
    )]
    pub metrics_address: MetricsAddress,
    /// The kubelet's PodResources socket, read to label EFA traffic with its pod (when present).
    #[arg(
        long,
        env = "EFA_DP_POD_RESOURCES_SOCKET",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock",
        value_name = "FILE",
        global = true
    )]
    pub pod_resources_socket: PathBuf,
    /// The kubelet's plugin registration dir, where DRA drivers register.
    #[arg(
        long,
        env = "EFA_DP_PLUGINS_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry",
        value_name = "DIR",
        global = true
    )]
    pub plugins_registry_dir: PathBuf,
    /// DRA drivers that manage EFAs; while one is registered every device is withheld.
    #[arg(
        long,
        env = "EFA_DP_DRA_DRIVERS",
        default_value = "dra.net",
        value_name = "NAME,...",
        value_parser = parse_driver_names,
        global = true
    )]
    pub dra_drivers: DriverNames,
    /// Keep advertising devices while an EFA DRA driver is registered on the node.
    #[arg(
        long,
        env = "EFA_DP_ALLOW_DRA_COEXISTENCE",
        value_name = "BOOL",
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true",
        value_parser = parse_bool,
        global = true
    )]
    pub allow_dra_coexistence: bool,
    /// Node-feature-discovery local feature file to keep current (e.g.
    /// /etc/kubernetes/node-feature-discovery/features.d/efa); empty disables it.
    #[arg(
        long,
        env = "EFA_DP_NFD_FEATURES_FILE",
        default_value = "",
        value_name = "FILE",
        value_parser = parse_optional_path,
        global = true
    )]
    pub nfd_features_file: OptionalPath,
    /// How Allocate hands devices to the runtime: device-specs (DeviceSpecs, every kubelet and
    /// runtime) or cdi (CDI names and a spec file; kubelet 1.28+ and a runtime with CDI on).
    #[arg(
        long,
        env = "EFA_DP_DEVICE_LIST_STRATEGY",
        value_enum,
        default_value = "device-specs",
        global = true
    )]
    pub device_list_strategy: DeviceListStrategy,
    /// Directory the runtime reads CDI specs from; the plugin writes its spec there in cdi mode.
    #[arg(
        long,
        env = "EFA_DP_CDI_SPEC_DIR",
        default_value = "/var/run/cdi",
        value_name = "DIR",
        global = true
    )]
    pub cdi_spec_dir: PathBuf,
    /// Environment variable set in every container that gets an EFA; repeatable. A comma starts
    /// another pair only when an '=' follows before the next comma, so values may hold commas.
    #[arg(
        long,
        env = "EFA_DP_ALLOCATE_ENV",
        value_name = "KEY=VALUE",
        value_parser = parse_env_pairs,
        action = clap::ArgAction::Append,
        global = true
    )]
    pub allocate_env: Vec<EnvPairs>,
    /// Label EFA hardware counters with the namespace, pod and container holding the device.
    #[arg(
        long,
        env = "EFA_DP_COUNTER_POD_LABELS",
        value_name = "BOOL",
        default_value_t = true,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true",
        value_parser = parse_bool,
        global = true
    )]
    pub counter_pod_labels: bool,
    /// TEST ONLY: judge an empty regular file at a uverbs node path Healthy, for simulated nodes
    /// built without CAP_MKNOD. Never set it on a real node.
    #[arg(
        long,
        env = "EFA_DP_TEST_ONLY_REGULAR_FILE_NODES",
        value_name = "BOOL",
        default_value_t = false,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true",
        value_parser = parse_bool,
        global = true
    )]
    pub test_only_regular_file_nodes: bool,
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

/// `KEY=VALUE` pairs from one `--allocate-env` (or `EFA_DP_ALLOCATE_ENV`), in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvPairs(pub Vec<(String, String)>);

/// `None` when the endpoint is disabled. A named type, so clap parses the whole flag into it.
pub type MetricsAddress = Option<SocketAddr>;
/// A list kept as one value, so clap, the environment and the file all give it the same way.
pub type DriverNames = Vec<String>;
pub type OptionalPath = Option<PathBuf>;

/// The config file: the same options, keyed by their long names. Unknown keys are errors, so a
/// typo cannot silently fall back to a default.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    sysfs_root: Option<PathBuf>,
    dev_root: Option<PathBuf>,
    device_plugin_dir: Option<PathBuf>,
    resource_name: Option<String>,
    rescan_interval: Option<String>,
    log_format: Option<String>,
    log_level: Option<String>,
    metrics_address: Option<String>,
    pod_resources_socket: Option<PathBuf>,
    plugins_registry_dir: Option<PathBuf>,
    dra_drivers: Option<Vec<String>>,
    allow_dra_coexistence: Option<bool>,
    nfd_features_file: Option<PathBuf>,
    device_list_strategy: Option<String>,
    cdi_spec_dir: Option<PathBuf>,
    counter_pod_labels: Option<bool>,
    sharing: Option<FileSharing>,
    allocate: Option<FileAllocate>,
}

/// `allocate:` in the config file: what every allocation gets besides its devices.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
struct FileAllocate {
    /// Values kept as YAML, so `FI_EFA_USE_DEVICE_RDMA: 1` is the string "1".
    env: Option<BTreeMap<String, serde_yaml::Value>>,
}

/// `sharing:` in the config file, grouped because more sharing knobs may follow.
#[derive(Deserialize, Default, Debug)]
#[serde(deny_unknown_fields)]
struct FileSharing {
    /// Kept as YAML so `replicas: 0` and `replicas: four` get the flag's own message.
    replicas: Option<serde_yaml::Value>,
}

/// The validated configuration the plugin runs with.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub struct Settings {
    pub sysfs_root: PathBuf,
    pub dev_root: PathBuf,
    pub device_plugin_dir: PathBuf,
    pub resource_name: String,
    #[serde(serialize_with = "serialize_duration")]
    pub rescan_interval: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
    pub sharing: Sharing,
    #[serde(serialize_with = "serialize_optional")]
    pub metrics_address: Option<SocketAddr>,
    pub pod_resources_socket: PathBuf,
    pub plugins_registry_dir: PathBuf,
    pub dra_drivers: Vec<String>,
    pub allow_dra_coexistence: bool,
    #[serde(serialize_with = "serialize_optional_path")]
    pub nfd_features_file: Option<PathBuf>,
    pub counter_pod_labels: bool,
    /// Deliberately not readable from the config file: a test switch belongs on a test's
    /// command line, where it is seen; shown only when on.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub test_only_regular_file_nodes: bool,
    pub device_list_strategy: DeviceListStrategy,
    pub cdi_spec_dir: PathBuf,
    pub allocate: AllocateSettings,
}

/// What every allocation gets besides its devices.
#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct AllocateSettings {
    /// Set in each container: through the Allocate answer with device-specs, through the CDI
    /// spec with cdi.
    pub env: BTreeMap<String, String>,
}

impl Default for Settings {
    fn default() -> Self {
        let cli = Cli::parse_from(["efa-device-plugin"]);
        let o = cli.options;
        Settings {
            sysfs_root: o.sysfs_root,
            dev_root: o.dev_root,
            device_plugin_dir: o.device_plugin_dir,
            resource_name: o.resource_name,
            rescan_interval: o.rescan_interval,
            log_format: o.log_format,
            log_level: o.log_level,
            sharing: Sharing::replicas(o.sharing_replicas),
            metrics_address: o.metrics_address,
            pod_resources_socket: o.pod_resources_socket,
            plugins_registry_dir: o.plugins_registry_dir,
            dra_drivers: o.dra_drivers,
            allow_dra_coexistence: o.allow_dra_coexistence,
            nfd_features_file: o.nfd_features_file,
            device_list_strategy: o.device_list_strategy,
            cdi_spec_dir: o.cdi_spec_dir,
            allocate: AllocateSettings::default(),
            counter_pod_labels: o.counter_pod_labels,
            test_only_regular_file_nodes: o.test_only_regular_file_nodes,
        }
    }
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
pub const MIN_RESCAN_INTERVAL: Duration = Duration::from_millis(100);

/// Parses a duration such as `500ms` or `2s`; below [`MIN_RESCAN_INTERVAL`] is refused because
/// it would spin.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|err| format!("invalid duration {text:?}: {err} (use e.g. 500ms, 2s, 1m)"))?;
    if d < MIN_RESCAN_INTERVAL {
        return Err(format!(
            "invalid duration {text:?}: must be at least {}",
            humantime::format_duration(MIN_RESCAN_INTERVAL)
        ));
    }
    Ok(d)
}

/// `host:port`, or empty for no endpoint. Only an IP literal: resolving a name would make start-up
/// depend on DNS.
pub fn parse_metrics_address(text: &str) -> Result<Option<SocketAddr>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| {
        format!("invalid address {text:?}: use IP:PORT, e.g. 0.0.0.0:9465, or \"\" to disable")
    })
}

/// Comma-separated driver names, e.g. `dra.net,efa.example.com`.
pub fn parse_driver_names(text: &str) -> Result<Vec<String>, String> {
    let names: Vec<String> = text
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect();
    match names.iter().find(|name| name.contains('/')) {
        Some(name) => Err(format!(
            "invalid driver name {name:?}: must not contain '/'"
        )),
        None => Ok(names),
    }
}

pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("invalid value {text:?}: use true or false")),
    }
}

/// One or more `KEY=VALUE` pairs. A comma starts another pair only when an `=` follows it
/// before the next comma, so `NCCL_SOCKET_IFNAME=^lo,docker` stays one pair.
pub fn parse_env_pairs(text: &str) -> Result<EnvPairs, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for piece in text.split(',') {
        match (piece.split_once('='), pairs.last_mut()) {
            (Some((key, value)), _) => pairs.push((key.to_owned(), value.to_owned())),
            (None, Some((_, value))) => {
                value.push(',');
                value.push_str(piece);
            }
            (None, None) => {
                return Err(format!("invalid environment entry {text:?}: use KEY=VALUE"));
            }
        }
    }
    for (key, value) in &pairs {
        validate_env(key, value)?;
    }
    Ok(EnvPairs(pairs))
}

/// What the runtime can set: a POSIX name, and a value that fits in a C string.
pub fn validate_env(key: &str, value: &str) -> Result<(), String> {
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
pub fn validate_resource_name(name: &str) -> Result<(), String> {
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

/// Merges one setting: a flag or env value wins; otherwise the file's value, parsed like a flag.
struct Merge<'a> {
    matches: &'a ArgMatches,
    path: Option<&'a Path>,
}

impl Merge<'_> {
    fn pick<T>(
        &self,
        key: &str,
        given: T,
        from_file: Option<String>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        self.pick_nested(key, key, given, from_file, parse)
    }

    /// Like [`Merge::pick`] for a setting the file spells differently, e.g. `sharing.replicas`.
    fn pick_nested<T>(
        &self,
        key: &str,
        file_key: &str,
        given: T,
        from_file: Option<String>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let id = key.replace('-', "_");
        if self.matches.value_source(&id) != Some(ValueSource::DefaultValue) {
            return Ok(given);
        }
        match (from_file, self.path) {
            (Some(text), Some(path)) => parse(&text)
                .map_err(|err| ConfigError(format!("{}: {err}", Origin::File(path, file_key)))),
            _ => Ok(given),
        }
    }

    fn origin<'k>(&self, key: &'k str, env: &'k str) -> Origin<'k>
    where
        Self: 'k,
    {
        match self.matches.value_source(&key.replace('-', "_")) {
            Some(ValueSource::EnvVariable) => Origin::Env(env),
            Some(ValueSource::DefaultValue) | None => match self.path {
                Some(path) => Origin::File(path, key),
                None => Origin::Flag(key),
            },
            _ => Origin::Flag(key),
        }
    }
}

/// A config file is a few hundred bytes; the cap keeps a wrong path (a log, a disk image) from
/// being read whole.
pub const CONFIG_SIZE_LIMIT: u64 = 1 << 20;
/// The schema nests two levels; the YAML parser's cost grows with the square of the depth, so
/// deeper input is refused before it is parsed.
pub const CONFIG_DEPTH_LIMIT: usize = 32;

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let problem = |what: String| ConfigError(format!("config file {}: {what}", path.display()));
    let text = crate::fsread::read_text(path, CONFIG_SIZE_LIMIT)
        .map_err(|err| problem(err.to_string()))?;
    if text.trim().is_empty() {
        return Ok(FileConfig::default());
    }
    let depth = nesting_depth(&text);
    if depth > CONFIG_DEPTH_LIMIT {
        return Err(problem(format!(
            "nested {depth} levels deep, more than the {CONFIG_DEPTH_LIMIT} allowed"
        )));
    }
    serde_yaml::from_str(&text).map_err(|err| {
        ConfigError(format!(
            "config file {}: {}",
            path.display(),
            err.to_string().replace('\n', " ")
        ))
    })
}

/// Parses the command line (and environment, and config file) into a command and its settings.
pub fn parse<I, T>(args: I) -> Result<(Command, Settings), clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let command = cli.command.clone().unwrap_or(Command::Run);
    let settings = settings_from(&cli.options, &matches)
        .map_err(|err| Cli::command().error(clap::error::ErrorKind::ValueValidation, err.0))?;
    Ok((command, settings))
}

fn settings_from(options: &Options, matches: &ArgMatches) -> Result<Settings, ConfigError> {
    let file = match &options.config {
        Some(path) => read_file(path)?,
        None => FileConfig::default(),
    };
    let merge = Merge {
        matches,
        path: options.config.as_deref(),
    };
    let path = |text: &str| Ok(PathBuf::from(text));
    let settings = Settings {
        sysfs_root: merge.pick(
            "sysfs-root",
            options.sysfs_root.clone(),
            file.sysfs_root.map(|p| p.display().to_string()),
            path,
        )?,
        dev_root: merge.pick(
            "dev-root",
            options.dev_root.clone(),
            file.dev_root.map(|p| p.display().to_string()),
            path,
        )?,
        device_plugin_dir: merge.pick(
            "device-plugin-dir",
            options.device_plugin_dir.clone(),
            file.device_plugin_dir.map(|p| p.display().to_string()),
            path,
        )?,
        resource_name: merge.pick(
            "resource-name",
            options.resource_name.clone(),
            file.resource_name,
            |text| Ok(text.to_owned()),
        )?,
        rescan_interval: merge.pick(
            "rescan-interval",
            options.rescan_interval,
            file.rescan_interval,
            parse_interval,
        )?,
        log_format: merge.pick("log-format", options.log_format, file.log_format, |text| {
            LogFormat::from_str(text, false)
                .map_err(|_| format!("invalid value {text:?}: use text or json"))
        })?,
        log_level: merge.pick(
            "log-level",
            options.log_level.clone(),
            file.log_level,
            |text| Ok(text.to_owned()),
        )?,
        sharing: Sharing::replicas(
            merge.pick_nested(
                "sharing-replicas",
                "sharing.replicas",
                options.sharing_replicas,
                file.sharing
                    .and_then(|sharing| sharing.replicas)
                    .map(|value| yaml_scalar(&value)),
                parse_replicas,
            )?,
        ),
        metrics_address: merge.pick(
            "metrics-address",
            options.metrics_address,
            file.metrics_address,
            parse_metrics_address,
        )?,
        pod_resources_socket: merge.pick(
            "pod-resources-socket",
            options.pod_resources_socket.clone(),
            file.pod_resources_socket.map(|p| p.display().to_string()),
            path,
        )?,
        plugins_registry_dir: merge.pick(
            "plugins-registry-dir",
            options.plugins_registry_dir.clone(),
            file.plugins_registry_dir.map(|p| p.display().to_string()),
            path,
        )?,
        dra_drivers: merge.pick(
            "dra-drivers",
            options.dra_drivers.clone(),
            file.dra_drivers.map(|names| names.join(",")),
            parse_driver_names,
        )?,
        allow_dra_coexistence: merge.pick(
            "allow-dra-coexistence",
            options.allow_dra_coexistence,
            file.allow_dra_coexistence.map(|b| b.to_string()),
            parse_bool,
        )?,
        nfd_features_file: merge.pick(
            "nfd-features-file",
            options.nfd_features_file.clone(),
            file.nfd_features_file.map(|p| p.display().to_string()),
            parse_optional_path,
        )?,
        device_list_strategy: merge.pick(
            "device-list-strategy",
            options.device_list_strategy,
            file.device_list_strategy,
            |text| {
                DeviceListStrategy::from_str(text, false)
                    .map_err(|_| format!("invalid value {text:?}: use device-specs or cdi"))
            },
        )?,
        cdi_spec_dir: merge.pick(
            "cdi-spec-dir",
            options.cdi_spec_dir.clone(),
            file.cdi_spec_dir.map(|p| p.display().to_string()),
            path,
        )?,
        allocate: AllocateSettings {
            env: allocate_env(&merge, options, file.allocate.and_then(|a| a.env))?,
        },
        counter_pod_labels: merge.pick(
            "counter-pod-labels",
            options.counter_pod_labels,
            file.counter_pod_labels.map(|b| b.to_string()),
            parse_bool,
        )?,
        test_only_regular_file_nodes: options.test_only_regular_file_nodes,
    };
    validate_resource_name(&settings.resource_name).map_err(|err| {
        ConfigError(format!(
            "{}: {err}",
            merge.origin("resource-name", "EFA_DP_RESOURCE_NAME")
        ))
    })?;
    if settings.device_list_strategy == DeviceListStrategy::Cdi {
        crate::cdi::Kind::of(&settings.resource_name).map_err(|err| {
            ConfigError(format!(
                "{}: {err} (needed by --device-list-strategy=cdi)",
                merge.origin("resource-name", "EFA_DP_RESOURCE_NAME")
            ))
        })?;
    }
    Ok(settings)
}

/// The flag's or variable's pairs when given, else the file's map, each entry checked alike.
fn allocate_env(
    merge: &Merge,
    options: &Options,
    from_file: Option<BTreeMap<String, serde_yaml::Value>>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let given = options
        .allocate_env
        .iter()
        .flat_map(|pairs| pairs.0.iter().cloned())
        .collect();
    if merge.matches.value_source("allocate_env").is_some() {
        return Ok(given);
    }
    let (Some(entries), Some(path)) = (from_file, merge.path) else {
        return Ok(given);
    };
    entries
        .into_iter()
        .map(|(key, value)| {
            let checked = match &value {
                serde_yaml::Value::String(_)
                | serde_yaml::Value::Number(_)
                | serde_yaml::Value::Bool(_) => {
                    let text = yaml_scalar(&value);
                    validate_env(&key, &text).map(|()| text)
                }
                _ => Err(format!(
                    "the value of {key} must be a string, number or boolean (use \"\" for empty)"
                )),
            };
            checked.map(|text| (key.clone(), text)).map_err(|err| {
                ConfigError(format!(
                    "{}: {err}",
                    Origin::File(path, &format!("allocate.env.{key}"))
                ))
            })
        })
        .collect()
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

    #[test]
    fn an_empty_config_file_means_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.yaml");
        std::fs::write(&path, "\n").unwrap();
        let (_, settings) = parse([
            "efa-device-plugin",
            "--config",
            path.to_str().unwrap(),
            "config",
        ])
        .unwrap();
        assert_eq!(settings, Settings::default());
    }
}
