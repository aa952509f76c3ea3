//! The settings table: every setting's field, its help (the doc comment) and the descriptor
//! with its flag, variable, file key, default and the one parser that reads its text,
//! whichever source the text came from.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use serde::Serialize;

use super::allocate_env::{AllocateSettings, EnvSetting};
use super::file::{VERSION_KEY, VERSIONS};
use super::origin::{ConfigError, Origin};
use super::parsers::{
    LogLevel, parse_device_nodes, parse_driver_names, parse_interval, parse_metrics_address,
    parse_optional_path, parse_path, parse_sharing, parse_socket_names,
};
use super::resource_name::ResourceName;
use super::setting::{Describe, FileKey, Given, Resolve, Setting, help_text};
use crate::allocation::sharing::Sharing;
use crate::discovery::DeviceIdStrategy;
use crate::telemetry::LogFormat;

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

/// Declares [`Settings`], the [`Origins`] of its values and, per field, the descriptor that
/// reads it; the field's doc comment is its `--help` text. A field under `#[cfg]` exists, on
/// the command line too, only in the builds the condition names.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $(#[cfg($cfg:meta)])?
        $(#[serde($($serde:tt)*)])?
        $field:ident: $ty:ty = $declared:expr;
    )+) => {
        /// The validated configuration the plugin runs with.
        #[derive(Serialize, Clone, PartialEq, Eq)]
        #[serde(rename_all = "kebab-case")]
        pub struct Settings {
            $( $(#[doc = $doc])+ $(#[cfg($cfg)])? $(#[serde($($serde)*)])? pub $field: $ty, )+
            /// Where each value came from, for the checks made once the node is scanned or a
            /// port bound.
            #[serde(skip)]
            pub origins: Origins,
        }

        /// Where each of the [`Settings`] came from, field by field.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct Origins {
            $( $(#[cfg($cfg)])? pub $field: Origin, )+
        }

        /// The values alone: the start-up log shows what the plugin runs with.
        impl fmt::Debug for Settings {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let mut fields = f.debug_struct("Settings");
                $( $(#[cfg($cfg)])? fields.field(stringify!($field), &self.$field); )+
                fields.finish()
            }
        }

        /// Each field's descriptor, typed by the field.
        pub(super) struct Declared {
            $( $(#[cfg($cfg)])? pub(super) $field: &'static dyn Resolve<$ty>, )+
        }

        pub(super) const DECLARED: Declared = Declared {
            $( $(#[cfg($cfg)])? $field: &$declared, )+
        };

        impl Declared {
            /// The descriptors in field order, each with its doc comment.
            pub(super) fn each(&self) -> Vec<(&'static dyn Describe, &'static str)> {
                // Each doc line starts with its space, so the lines join into one paragraph.
                vec![$( $(#[cfg($cfg)])? (self.$field, concat!($($doc),+)), )+]
            }

            pub(super) fn resolve(&self, given: &Given) -> Result<Settings, ConfigError> {
                $( $(#[cfg($cfg)])? let $field = self.$field.resolve(given)?; )+
                Ok(Settings {
                    $( $(#[cfg($cfg)])? $field: $field.0, )+
                    origins: Origins { $( $(#[cfg($cfg)])? $field: $field.1, )+ },
                })
            }
        }
    };
}

settings! {
    /// Root of the sysfs tree to scan for EFA devices.
    sysfs_root: PathBuf = Setting::new("sysfs-root", "EFA_DP_SYSFS_ROOT", "DIR", "/sys",
        parse_path).naming_a_path();
    /// Root of the device tree holding infiniband/uverbsN.
    dev_root: PathBuf = Setting::new("dev-root", "EFA_DP_DEV_ROOT", "DIR", "/dev", parse_path)
        .naming_a_path();
    /// Directory holding the kubelet's kubelet.sock; the plugin serves its socket there.
    device_plugin_dir: PathBuf = Setting::new("device-plugin-dir", "EFA_DP_DEVICE_PLUGIN_DIR",
        "DIR", "/var/lib/kubelet/device-plugins", parse_path).naming_a_path();
    /// Extended resource name to advertise.
    resource_name: ResourceName = Setting::new("resource-name", "EFA_DP_RESOURCE_NAME", "NAME",
        "vpc.amazonaws.com/efa", ResourceName::parse);
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
    /// Judge an EFA Unhealthy while its driver has closed its admin queue (its device-level
    /// hw counter no_completion_cmds is not 0), until the device is probed again.
    admin_queue_health: bool = Setting::switch("admin-queue-health",
        "EFA_DP_ADMIN_QUEUE_HEALTH", "true");
    /// Log line format.
    log_format: LogFormat = Setting::choice("log-format", "EFA_DP_LOG_FORMAT", "LOG_FORMAT", "text");
    /// Log level or filter directives, each naming its level; RUST_LOG, when set and not
    /// empty, takes precedence and is checked alike.
    log_level: LogLevel = Setting::new("log-level", "EFA_DP_LOG_LEVEL", "LEVEL", "info",
        LogLevel::parse);
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
        parse_path).naming_a_path();
    /// The kubelet's plugin registration dir, where DRA drivers register.
    plugins_registry_dir: PathBuf = Setting::new("plugins-registry-dir",
        "EFA_DP_PLUGINS_REGISTRY_DIR", "DIR", "/var/lib/kubelet/plugins_registry", parse_path)
        .naming_a_path();
    /// DRA drivers that manage EFAs, by name (lowercase DNS subdomains, e.g. dra.net); while
    /// one is registered every device is withheld. Empty only with --allow-dra-coexistence.
    // DRANET, and AWS's networking DRA driver, which serves EFAs as well as RoCE and ENA:
    // the plugin cannot read its ResourceSlices to tell which it serves on this node.
    dra_drivers: Vec<String> = Setting::list("dra-drivers", "EFA_DP_DRA_DRIVERS", "NAME,...",
        "dra.net,dra.networking.k8s.aws", parse_driver_names);
    /// Keep advertising devices while an EFA DRA driver is registered on the node.
    allow_dra_coexistence: bool = Setting::switch("allow-dra-coexistence",
        "EFA_DP_ALLOW_DRA_COEXISTENCE", "false");
    /// Node-feature-discovery local feature file to keep current (e.g.
    /// /etc/kubernetes/node-feature-discovery/features.d/efa); empty disables it.
    #[serde(serialize_with = "serialize_optional_path")]
    nfd_features_file: Option<PathBuf> = Setting::new("nfd-features-file",
        "EFA_DP_NFD_FEATURES_FILE", "FILE", "", parse_optional_path).naming_a_path();
    /// How Allocate hands devices to the runtime: device-specs (DeviceSpecs, every kubelet and
    /// runtime) or cdi (CDI names and a spec file; kubelet 1.28+ and a runtime with CDI on).
    device_list_strategy: DeviceListStrategy = Setting::choice("device-list-strategy",
        "EFA_DP_DEVICE_LIST_STRATEGY", "DEVICE_LIST_STRATEGY", "device-specs");
    /// Directory the runtime reads CDI specs from; the plugin writes its spec there in cdi mode.
    cdi_spec_dir: PathBuf = Setting::new("cdi-spec-dir", "EFA_DP_CDI_SPEC_DIR", "DIR",
        "/var/run/cdi", parse_path).naming_a_path();
    /// Environment variable set in every container that gets an EFA; repeatable, each value
    /// kept whole, commas and '=' too. EFA_DP_ALLOCATE_ENV holds a YAML or JSON map instead,
    /// e.g. {"NCCL_SOCKET_IFNAME": "^lo,docker", "FI_PROVIDER": "efa"}.
    allocate: AllocateSettings = EnvSetting {
        flag: "allocate-env", env: "EFA_DP_ALLOCATE_ENV", value_name: "KEY=VALUE",
        file: "allocate.env",
    };
    /// Host device nodes every container with EFAs also gets, e.g. /dev/gdrdrv (GDRCopy, for
    /// GPU-initiated networking): each as found below the dev root at start and every rescan,
    /// with its own major:minor; one that is missing is left out and logged. One that is, or
    /// links to, an EFA's uverbs node or a node outside the dev root is refused: at start the
    /// plugin exits, later it is withheld and logged.
    extra_device_nodes: Vec<String> = Setting::list("extra-device-nodes",
        "EFA_DP_EXTRA_DEVICE_NODES", "PATH,...", "", parse_device_nodes);
    /// Expose efa_device_allocation: the namespace, pod and container holding each device.
    counter_pod_labels: bool = Setting::switch("counter-pod-labels", "EFA_DP_COUNTER_POD_LABELS",
        "true");
    /// TEST ONLY: judge an empty regular file at a uverbs node path Healthy, for simulated nodes
    /// built without CAP_MKNOD. Never set it on a real node.
    #[cfg(feature = "testkit")]
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

/// The config file's JSON schema, from the settings table: each key with its value's schema
/// and its `--help` text, nested at the dots, and no other key, as the file reader insists.
pub fn file_schema() -> serde_json::Value {
    fn object() -> serde_json::Value {
        serde_json::json!({ "type": "object", "additionalProperties": false, "properties": {} })
    }
    let mut schema = object();
    schema["properties"][VERSION_KEY] = serde_json::json!({
        "enum": VERSIONS,
        "description": "The file's format; without it, v1",
    });
    for (setting, doc) in DECLARED.each() {
        let Some(key) = setting.file_key() else {
            continue;
        };
        let mut parts: Vec<&str> = key.split('.').collect();
        let last = parts.pop().unwrap_or(key);
        let mut level = &mut schema;
        for part in parts {
            level = level["properties"]
                .as_object_mut()
                .expect("an object schema")
                .entry(part)
                .or_insert_with(object);
        }
        let mut value = setting.file_schema();
        value["description"] = help_text(doc).into();
        level["properties"][last] = value;
    }
    schema
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
