//! Command line, environment and config file, merged into one validated [`Settings`].
//!
//! Precedence is flag, then `EFA_DP_<NAME>`, then the YAML file given by `--config`, then the
//! default. Every problem is reported as one line that names the flag, variable or file.
//!
//! Each setting is declared once, in the settings table ([`table`]): its field, its help (the
//! doc comment) and a descriptor with its flag, variable, file key, default and the one parser
//! that reads its text, whichever source the text came from. A descriptor is a row type of
//! [`setting`]; the file is read in [`file`], the texts parsed in [`parsers`].

mod allocate_env;
mod depth;
mod file;
mod listing;
mod origin;
mod parsers;
mod resource_name;
mod setting;
mod table;

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::health::Judge;

pub use allocate_env::AllocateSettings;
pub use listing::{OutputFormat, print_settings};
pub use origin::{ConfigError, Origin};
pub use parsers::{LogLevel, device_node_under};
pub use resource_name::ResourceName;
#[cfg(any(test, feature = "testkit"))]
pub(crate) use resource_name::validate_resource_name;
pub use table::{DeviceListStrategy, Origins, Settings, file_schema};

use parsers::parse_path;
use setting::{CONFIG, Given, flag_arg, help_text};
use table::DECLARED;

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
    /// Print the settings table: each setting's flag, variable, config file key, default and
    /// help, and whether its value is a path.
    Settings {
        #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Print the effective configuration (flags, environment and file merged) as YAML.
    Config {
        /// Print the config file's JSON schema instead, from the settings table (the Helm
        /// chart's schema of its `config` value is this output).
        #[arg(long, hide = true)]
        schema: bool,
    },
}

fn cli() -> clap::Command {
    let config = flag_arg(CONFIG.flag, CONFIG.env, CONFIG.value_name).help(CONFIG.help);
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

fn settings_from(matches: &ArgMatches) -> Result<Settings, ConfigError> {
    let config = match matches.get_one::<String>(CONFIG.flag) {
        Some(text) => {
            let origin = match matches.value_source(CONFIG.flag) {
                Some(ValueSource::EnvVariable) => Origin::Env(CONFIG.env),
                _ => Origin::Flag(CONFIG.flag),
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
    let mut settings = DECLARED.resolve(&given)?;
    if let Some(level) = rust_log()? {
        settings.log_level = level;
        settings.origins.log_level = Origin::Env(RUST_LOG);
    }
    if settings.dra_drivers.is_empty() && !settings.allow_dra_coexistence {
        let origin = &settings.origins.dra_drivers;
        return Err(ConfigError(format!(
            "{origin}: no driver names, which would leave the DRA-conflict guard watching for \
             none; name the EFA DRA drivers, or turn the guard off with --allow-dra-coexistence"
        )));
    }
    if settings.device_list_strategy == DeviceListStrategy::Cdi
        && let Err(err) = settings.resource_name.cdi_kind()
    {
        let origin = &settings.origins.resource_name;
        return Err(ConfigError(format!(
            "{origin}: {err} (needed by --device-list-strategy=cdi)"
        )));
    }
    Ok(settings)
}

/// The variable every Rust program's logger reads. It overrides `--log-level` however that was
/// given, so it is read here, with the other settings, and judged by the same parser: the
/// logger would read a bad one as a filter that logs nothing.
const RUST_LOG: &str = "RUST_LOG";

/// `RUST_LOG`'s level; `None` when it is unset or empty, as every logger reads it.
fn rust_log() -> Result<Option<LogLevel>, ConfigError> {
    let origin = Origin::Env(RUST_LOG);
    match std::env::var(RUST_LOG) {
        Ok(text) if text.is_empty() => Ok(None),
        Ok(text) => LogLevel::parse(&text)
            .map(Some)
            .map_err(|err| ConfigError(format!("{origin}: {err}"))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(ConfigError(format!("{origin}: must be UTF-8 text")))
        }
    }
}

impl Settings {
    /// The health rules these settings ask for: the product's, on their dev root, and in a test
    /// build the test switch's regular files too. The plugin and `list` judge alike through it.
    pub fn judge(&self) -> Judge {
        let judge = Judge::new(self.dev_root.clone()).checking_admin_queue(self.admin_queue_health);
        #[cfg(feature = "testkit")]
        let judge = judge.accepting_regular_files(self.test_only_regular_file_nodes);
        judge
    }

    /// Each of `--extra-device-nodes` as containers name it, with where it is on the host.
    pub(crate) fn extra_device_nodes_on_host(&self) -> Vec<(String, PathBuf)> {
        self.extra_device_nodes
            .iter()
            .map(|node| (node.clone(), device_node_under(&self.dev_root, node)))
            .collect()
    }
}

/// Reads the file given by `--config` into its values by dotted key.
fn read_file(path: &Path) -> Result<file::FileValues, ConfigError> {
    let keys: Vec<&'static str> = DECLARED
        .each()
        .into_iter()
        .filter_map(|(setting, _)| setting.file_key())
        .collect();
    let mut document = file::read(path, &keys)?;
    if let Some(key) = DECLARED.allocate.file_key() {
        allocate_env::keep_file_text(&mut document.values, key, &document.text);
    }
    Ok(document.values)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;

    /// The settings a config file holding `text` gives.
    pub(crate) fn from_file(text: &str) -> Settings {
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
            assert_eq!(settings.resource_name.as_str(), "vpc.amazonaws.com/efa");
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
        let keys = "(the keys are the long flag names, see --help)";
        for (text, named) in [
            ("sharing:\n  replica: 2\n", "unknown key `sharing.replica`"),
            ("rescan-interval: 1s\nrescan-interval: 2s\n", "duplicate"),
            // A scalar or a list where a group belongs, and a document that is no map.
            (
                "sharing: 2\n",
                "sharing: must be a map of settings (replicas), not a number",
            ),
            (
                "sharing: [2]\n",
                "sharing: must be a map of settings (replicas), not a list",
            ),
            (
                "- rescan-interval: 2s\n",
                "must be a map of settings, not a list",
            ),
            // A key that is a list or a map, which YAML allows, over several lines.
            (
                "? - a\n  - b\n: 1\n",
                &format!("a key is a list, not a setting's name {keys}"),
            ),
            (
                "sharing:\n  ? {a: 1}\n  : 2\n",
                &format!("sharing: a key is a map, not a setting's name {keys}"),
            ),
            ("\"a\\nb\": 1\n", &format!("unknown key `a\\nb` {keys}")),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = read_file(&path).unwrap_err().0;
            let file = format!("config file {}: ", path.display());
            assert!(err.starts_with(&file), "{text:?}: {err}");
            assert!(err.contains(named), "{text:?}: {err}");
            assert!(!err.contains('\n'), "{text:?}: {err}");
        }
        // A group left empty, like a setting, sets nothing.
        std::fs::write(&path, "sharing:\n  # replicas: 2\n").unwrap();
        assert!(read_file(&path).unwrap().is_empty());
    }
}
