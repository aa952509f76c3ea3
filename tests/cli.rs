//! The command line: option precedence, one-line errors for bad input, `list`, `config`, `demo`.

mod support;

#[cfg(feature = "demo")]
use std::path::Path;

use efa_device_plugin::testkit::simulate::{FakeNode, Shape};
use support::{
    assert_one_line_error, binary_command, node_args, node_kind, run_binary, write_config,
};

#[test]
fn precedence_is_flag_env_file_default() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "rescan-interval: 3s\nresource-name: example.com/from-file\ndev-root: /file/dev\n",
    );
    let (code, stdout, stderr) = run_binary(
        &["--config", &config, "--rescan-interval", "1s", "config"],
        &[
            ("EFA_DP_RESCAN_INTERVAL", "2s"),
            ("EFA_DP_RESOURCE_NAME", "example.com/from-env"),
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
    assert_eq!(
        effective["rescan-interval"], "1s",
        "flag beats env and file"
    );
    assert_eq!(
        effective["resource-name"], "example.com/from-env",
        "env beats file"
    );
    assert_eq!(effective["dev-root"], "/file/dev", "file beats default");
    assert_eq!(effective["sysfs-root"], "/sys", "default");
    assert_eq!(
        effective["device-plugin-dir"],
        "/var/lib/kubelet/device-plugins"
    );
}

#[test]
fn defaults_match_the_contract() {
    let (code, stdout, _) = run_binary(&["config"], &[]);
    assert_eq!(code, 0);
    let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
    assert_eq!(effective["sysfs-root"], "/sys");
    assert_eq!(effective["dev-root"], "/dev");
    assert_eq!(effective["resource-name"], "vpc.amazonaws.com/efa");
    assert_eq!(effective["rescan-interval"], "5s");
    assert_eq!(effective["log-format"], "text");
}

#[test]
fn config_output_reads_back_as_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, first, _) = run_binary(
        &["--rescan-interval", "750ms", "--dev-root", "/x", "config"],
        &[],
    );
    let config = write_config(dir.path(), &first);
    let (code, second, stderr) = run_binary(&["--config", &config, "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(first, second);
}

#[test]
fn bad_yaml_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "rescan-interval: [1s\n");
    assert_one_line_error(run_binary(&["--config", &config], &[]), &[&config]);
}

#[test]
fn unknown_config_key_names_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "rescan-intervall: 1s\n");
    assert_one_line_error(
        run_binary(&["--config", &config], &[]),
        &[&config, "rescan-intervall"],
    );
}

#[test]
fn a_key_that_is_no_name_or_a_group_that_is_no_map_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    for (text, problem) in [
        // Printed as "unknown key `- a" and cut at the key's line break.
        (
            "? - a\n  - b\n: 1\n",
            "a key is a list, not a setting's name",
        ),
        // Printed as "sharing.expected a map of settings".
        (
            "sharing: 2\n",
            "sharing: must be a map of settings (replicas), not a number",
        ),
    ] {
        let config = write_config(dir.path(), text);
        assert_refused(
            &["--config", &config, "config"],
            &[],
            &format!("config file {config}: {problem}"),
        );
    }
}

/// Asserts that the binary exits 2 with one line on stderr, which holds `line`.
fn assert_refused(args: &[&str], env: &[(&str, &str)], line: &str) {
    let result = run_binary(args, env);
    assert_eq!(result.0, 2, "{args:?} {env:?}: {}", result.2);
    assert_one_line_error(result, &[line]);
}

/// A health rule turned off by a typo would leave `/healthz` green while the check is off: each
/// health setting's bad value stops the start, naming the flag, variable or file key.
#[test]
fn a_bad_health_setting_stops_the_start_naming_it() {
    assert_refused(
        &["--admin-queue-health", "maybe", "config"],
        &[],
        "error: --admin-queue-health: invalid value \"maybe\": use true or false",
    );
    assert_refused(
        &["config"],
        &[("EFA_DP_ADMIN_QUEUE_HEALTH", "enabled")],
        "error: EFA_DP_ADMIN_QUEUE_HEALTH: invalid value \"enabled\": use true or false",
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "admin-queue-health: 2\n");
    assert_refused(
        &["--config", &config, "config"],
        &[],
        "admin-queue-health: invalid value \"2\": use true or false",
    );
    assert_refused(
        &["config"],
        &[("EFA_DP_RESCAN_INTERVAL", "0s")],
        "error: EFA_DP_RESCAN_INTERVAL: invalid duration \"0s\": must be at least 100ms",
    );
    let (code, stdout, stderr) = run_binary(&["--admin-queue-health=false", "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("admin-queue-health: false"), "{stdout}");
}

#[test]
fn missing_config_file_is_named() {
    assert_one_line_error(
        run_binary(&["--config", "/nonexistent/efa.yaml"], &[]),
        &["/nonexistent/efa.yaml"],
    );
}

#[test]
fn unparsable_durations_name_their_source() {
    assert_one_line_error(
        run_binary(&["--rescan-interval", "soon"], &[]),
        &["--rescan-interval", "soon"],
    );
    assert_one_line_error(
        run_binary(&["--rescan-interval", "0s"], &[]),
        &["--rescan-interval"],
    );
    assert_one_line_error(
        run_binary(&[], &[("EFA_DP_RESCAN_INTERVAL", "5 parsecs")]),
        &["EFA_DP_RESCAN_INTERVAL", "parsecs"],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "rescan-interval: whenever\n");
    assert_one_line_error(
        run_binary(&["--config", &config], &[]),
        &[&config, "rescan-interval", "whenever"],
    );
}

#[test]
fn rescan_intervals_below_100ms_are_refused() {
    for interval in ["1ns", "99ms"] {
        assert_one_line_error(
            run_binary(&["--rescan-interval", interval, "config"], &[]),
            &["--rescan-interval", interval, "100ms"],
        );
    }
    let (code, stdout, stderr) = run_binary(&["--rescan-interval", "100ms", "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("rescan-interval: 100ms"), "{stdout}");
}

#[test]
fn rescan_intervals_above_an_hour_are_refused() {
    // 200000000000y overflowed the runtime's clock at the first /healthz, 500000000000y at start.
    for interval in ["61m", "200000000000y", "500000000000y"] {
        assert_one_line_error(
            run_binary(&["--rescan-interval", interval, "config"], &[]),
            &["--rescan-interval", interval, "at most 1h"],
        );
        assert_one_line_error(
            run_binary(&["config"], &[("EFA_DP_RESCAN_INTERVAL", interval)]),
            &["EFA_DP_RESCAN_INTERVAL", "at most 1h"],
        );
    }
    let (code, stdout, stderr) = run_binary(&["--rescan-interval", "1h", "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("rescan-interval: 1h"), "{stdout}");
}

#[test]
fn a_config_file_of_comments_only_means_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let (_, defaults, _) = run_binary(&["config"], &[]);
    for text in [
        "",
        "\n",
        "# settings for efa-device-plugin\n# rescan-interval: 2s\n",
    ] {
        let config = write_config(dir.path(), text);
        let (code, stdout, stderr) = run_binary(&["--config", &config, "config"], &[]);
        assert_eq!(code, 0, "{text:?}: {stderr}");
        assert_eq!(stdout, defaults, "{text:?}");
    }
}

#[test]
fn allocate_env_numbers_and_booleans_reach_containers_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "allocate:\n  env:\n    NCCL_VERSION: 1.10\n    MASK: 0x10\n    FLAG: True\n    RDMA: 1\n",
    );
    let env_of = |args: &[&str], env: &[(&str, &str)]| {
        let (code, stdout, stderr) = run_binary(args, env);
        assert_eq!(code, 0, "{stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        effective["allocate"]["env"].clone()
    };
    let expected: serde_yaml::Value =
        serde_yaml::from_str("{FLAG: 'True', MASK: '0x10', NCCL_VERSION: '1.10', RDMA: '1'}")
            .unwrap();
    assert_eq!(env_of(&["--config", &config, "config"], &[]), expected);
    assert_eq!(
        env_of(
            &["config"],
            &[(
                "EFA_DP_ALLOCATE_ENV",
                "{NCCL_VERSION: 1.10, MASK: 0x10, FLAG: True, RDMA: 1}"
            )]
        ),
        expected
    );
}

#[test]
fn an_empty_path_is_refused_naming_its_flag_variable_or_key() {
    let dir = tempfile::tempdir().unwrap();
    for flag in [
        "sysfs-root",
        "dev-root",
        "device-plugin-dir",
        "pod-resources-socket",
        "plugins-registry-dir",
        "cdi-spec-dir",
        "config",
    ] {
        let variable = format!("EFA_DP_{}", flag.to_uppercase().replace('-', "_"));
        let dashed = format!("--{flag}");
        for blank in ["", " "] {
            assert_one_line_error(
                run_binary(&[&dashed, blank, "config"], &[]),
                &[&dashed, "empty"],
            );
            let (code, _, stderr) = run_binary(&["config"], &[(&variable, blank)]);
            assert_eq!(code, 2, "{variable}={blank:?}: {stderr}");
            assert_one_line_error((code, String::new(), stderr), &[&variable, "empty"]);
        }
        if flag != "config" {
            let config = write_config(dir.path(), &format!("{flag}: \"\"\n"));
            let (code, _, stderr) = run_binary(&["--config", &config, "config"], &[]);
            assert_eq!(code, 2, "{flag} in the file: {stderr}");
            assert_one_line_error((code, String::new(), stderr), &[&config, flag, "empty"]);
        }
    }
    // The one path whose empty value has a meaning: no NFD file.
    let (code, stdout, stderr) = run_binary(&["--nfd-features-file", "", "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("nfd-features-file: ''"), "{stdout}");
}

#[test]
fn a_config_fifo_fails_at_once_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("config.yaml");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR).unwrap();
    let fifo = fifo.display().to_string();
    // On a FIFO without a writer, a plain read never returns: this would hang, not fail.
    assert_one_line_error(
        run_binary(&["--config", &fifo, "config"], &[]),
        &[&fifo, "not a regular file"],
    );
}

#[test]
fn oversized_or_deeply_nested_config_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let huge = write_config(dir.path(), &format!("# {}\n", "x".repeat(2 << 20)));
    assert_one_line_error(
        run_binary(&["--config", &huge, "config"], &[]),
        &[&huge, "larger than"],
    );
    // 40,000 levels took the YAML parser seconds; refused before parsing, it takes none.
    for deep in [
        format!("a: {}1{}\n", "[".repeat(40_000), "]".repeat(40_000)),
        format!("{}1\n", "- ".repeat(40_000)),
    ] {
        let path = write_config(dir.path(), &deep);
        assert_one_line_error(
            run_binary(&["--config", &path, "config"], &[]),
            &[&path, "nested 40000 levels deep"],
        );
    }
}

#[test]
fn invalid_resource_names_are_refused_like_the_kubelet_does() {
    for name in [
        "efa",
        "kubernetes.io/efa",
        "requests.example.com/efa",
        "Example.com/efa",
        "example.com/-efa",
    ] {
        assert_one_line_error(
            run_binary(&["--resource-name", name], &[]),
            &["--resource-name", name],
        );
    }
    assert_one_line_error(
        run_binary(&[], &[("EFA_DP_RESOURCE_NAME", "efa")]),
        &["EFA_DP_RESOURCE_NAME"],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "resource-name: nodomain\n");
    assert_one_line_error(
        run_binary(&["--config", &config], &[]),
        &[&config, "resource-name"],
    );
}

#[test]
fn a_bad_log_level_is_refused_naming_where_it_came_from() {
    assert_one_line_error(
        run_binary(&["config"], &[("EFA_DP_LOG_LEVEL", "info,efa=loud")]),
        &["EFA_DP_LOG_LEVEL", "invalid log level \"info,efa=loud\""],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "log-level: \"a[b\"\n");
    assert_one_line_error(
        run_binary(&["--config", &config, "config"], &[]),
        &[&format!(
            "config file {config}: log-level: invalid log level"
        )],
    );
}

/// The last line of a start that failed once the node was scanned or a port bound: the plugin
/// has logged before it.
fn last_line_of_a_failed_start(args: &[&str], env: &[(&str, &str)], code: i32) -> String {
    let (exit, _, stderr) = run_binary(args, env);
    assert_eq!(exit, code, "{stderr}");
    stderr.trim().lines().last().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn sharing_that_does_not_fit_the_node_names_where_the_count_came_from() {
    let h = support::Harness::new(Shape::Dense(1000));
    let spec_dir = h.root.path().join("cdi").display().to_string();
    let mut args = h.args();
    args.extend(["--device-list-strategy", "cdi", "--cdi-spec-dir", &spec_dir].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let last = last_line_of_a_failed_start(&args, &[("EFA_DP_SHARING_REPLICAS", "64")], 2);
    assert!(
        last.starts_with("EFA_DP_SHARING_REPLICAS 64: 1000 EFAs in cdi mode")
            && last.ends_with(" fit"),
        "{last}"
    );
}

#[test]
fn a_taken_metrics_port_stops_the_start_and_names_the_flag_or_variable_that_chose_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().display().to_string();
    let by_flag = last_line_of_a_failed_start(
        &[
            "--device-plugin-dir",
            &plugins,
            "--metrics-address",
            &address,
        ],
        &[],
        1,
    );
    assert!(
        by_flag.starts_with(&format!("error: --metrics-address {address}: ")),
        "{by_flag}"
    );
    let by_variable = last_line_of_a_failed_start(
        &["--device-plugin-dir", &plugins],
        &[("EFA_DP_METRICS_ADDRESS", &address)],
        1,
    );
    assert!(
        by_variable.starts_with(&format!("error: EFA_DP_METRICS_ADDRESS {address}: ")),
        "{by_variable}"
    );
}

#[test]
fn the_config_file_may_say_it_is_v1_and_no_other_version() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "version: v1\nrescan-interval: 2s\n");
    let (code, stdout, stderr) = run_binary(&["--config", &config, "config"], &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("rescan-interval: 2s"), "{stdout}");
    for (text, problem) in [
        (
            "version: v2\n",
            "unknown version \"v2\", this plugin reads v1",
        ),
        ("version: 1\n", "must be a string, one of v1"),
    ] {
        let config = write_config(dir.path(), text);
        assert_one_line_error(
            run_binary(&["--config", &config, "config"], &[]),
            &[&format!("config file {config}: version: {problem}")],
        );
    }
}

#[test]
fn a_log_level_that_names_no_level_is_refused_naming_where_it_came_from() {
    // The logger read `warnn` as a target to log at every level: the plugin started and logged
    // nothing at all.
    for level in ["warnn", "foo", ""] {
        assert_refused(
            &["config"],
            &[("EFA_DP_LOG_LEVEL", level)],
            &format!(
                "error: EFA_DP_LOG_LEVEL: invalid log level {level:?}: {level:?} names no level"
            ),
        );
    }
    assert_refused(
        &["--log-level", "warnn", "config"],
        &[],
        "error: --log-level: invalid log level \"warnn\"",
    );
    for level in [
        "info",
        "warn,efa_device_plugin=debug",
        "efa_device_plugin=trace",
    ] {
        let (code, stdout, stderr) = run_binary(&["config"], &[("EFA_DP_LOG_LEVEL", level)]);
        assert_eq!(code, 0, "{level}: {stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        assert_eq!(effective["log-level"], level);
    }
}

/// The logger keeps the spaces around a directive, while the check trimmed them: ` info` passed
/// and was read as a target named " info", so the plugin logged nothing at all. Each source's
/// text is now trimmed once, shown so by `config`, and the plugin logs at the level it names.
#[tokio::test]
async fn a_log_level_with_spaces_around_it_logs_at_that_level_from_flag_variable_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "log-level: \"warn, efa_device_plugin=info \"\n");
    let by_flag = ["--log-level", " info"];
    let by_file = ["--config", config.as_str()];
    for (args, env, stored) in [
        (&by_flag[..], None, "info"),
        (&[][..], Some(("EFA_DP_LOG_LEVEL", "info ")), "info"),
        (&by_file[..], None, "warn,efa_device_plugin=info"),
    ] {
        let env: Vec<(&str, &str)> = env.into_iter().collect();
        let (code, stdout, stderr) = run_binary(&[args, &["config"]].concat(), &env);
        assert_eq!(code, 0, "{args:?} {env:?}: {stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        assert_eq!(effective["log-level"], stored, "{args:?} {env:?}");

        let mut h = support::Harness::new(Shape::P4d);
        h.spawn_plugin_with(args, |command| {
            command.envs(env.iter().copied());
        });
        // Logged at info by the plugin's own target.
        h.registered_and_logged().await;
    }
}

#[test]
fn a_log_level_with_a_space_inside_is_refused_naming_where_it_came_from() {
    let level = "efa_device_plugin =debug";
    let problem = format!(
        "invalid log level {level:?}: {level:?} has a space inside, which the logger would read \
         as part of a target or level"
    );
    assert_refused(
        &["--log-level", level, "config"],
        &[],
        &format!("error: --log-level: {problem}"),
    );
    assert_refused(
        &["config"],
        &[("EFA_DP_LOG_LEVEL", level)],
        &format!("error: EFA_DP_LOG_LEVEL: {problem}"),
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &format!("log-level: {level}\n"));
    assert_refused(
        &["--config", &config, "config"],
        &[],
        &format!("error: config file {config}: log-level: {problem}"),
    );
}

/// RUST_LOG was read by the logger alone, unchecked: `RUST_LOG=warnn` started a plugin that
/// logged nothing, while `--log-level warnn` exited 2. It is now read with the settings.
#[test]
fn a_bad_rust_log_stops_the_start_with_one_line_naming_it() {
    let line = "error: RUST_LOG: invalid log level \"warnn\": \"warnn\" names no level";
    assert_refused(&["config"], &[("RUST_LOG", "warnn")], line);

    // The plugin itself exits at once, before it touches the node or the kubelet's dirs.
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    let (plugins, registry, pod_resources) = (
        path("device-plugins"),
        path("plugins_registry"),
        path("pod-resources.sock"),
    );
    let (sysfs, dev) = (path("sys"), path("dev"));
    let args = [
        "--device-plugin-dir",
        &plugins,
        "--plugins-registry-dir",
        &registry,
        "--pod-resources-socket",
        &pod_resources,
        "--sysfs-root",
        &sysfs,
        "--dev-root",
        &dev,
        "--metrics-address",
        "",
    ];
    let mut plugin = binary_command(&args, &[("RUST_LOG", "warnn")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + support::TIMEOUT;
    let status = loop {
        if let Some(status) = plugin.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            plugin.kill().unwrap();
            plugin.wait().unwrap();
            panic!("the plugin ran on with RUST_LOG=warnn");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut plugin.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert_one_line_error((2, String::new(), stderr), &[line]);
}

#[test]
fn rust_log_is_trimmed_like_the_log_level_and_wins_unless_empty() {
    let level = |env: &[(&str, &str)]| {
        let (code, stdout, stderr) = run_binary(&["--log-level", "warn", "config"], env);
        assert_eq!(code, 0, "{env:?}: {stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        effective["log-level"].as_str().unwrap().to_owned()
    };
    assert_eq!(level(&[("RUST_LOG", " debug")]), "debug");
    assert_eq!(level(&[("RUST_LOG", "")]), "warn", "empty, as unset");
}

#[test]
fn bad_log_format_is_named() {
    assert_one_line_error(run_binary(&["--log-format", "xml"], &[]), &["--log-format"]);
}

#[test]
fn a_bad_choice_names_the_variable_that_gave_it() {
    // Each printed "invalid value ... for '--<flag>'", and the empty one "a value is required
    // for '--device-id-strategy'": the flag, which was not given.
    for (variable, value, choices) in [
        ("EFA_DP_DEVICE_ID_STRATEGY", "foo", "use ibdev or pci"),
        ("EFA_DP_LOG_FORMAT", "xml", "use text or json"),
        (
            "EFA_DP_DEVICE_LIST_STRATEGY",
            "foo",
            "use device-specs or cdi",
        ),
        ("EFA_DP_DEVICE_ID_STRATEGY", "", "use ibdev or pci"),
    ] {
        assert_refused(
            &["config"],
            &[(variable, value)],
            &format!("error: {variable}: invalid value {value:?}: {choices}"),
        );
    }
    // The flag names itself, and --help still lists the choices.
    assert_refused(
        &["--log-format", "xml", "config"],
        &[],
        "error: --log-format: invalid value \"xml\": use text or json",
    );
    let (code, help, _) = run_binary(&["-h"], &[]);
    assert_eq!(code, 0);
    assert!(help.contains("[possible values: ibdev, pci]"), "{help}");
}

/// Runs the binary on `node` (its roots and, without root, the test-only switch), then `args`.
fn run_on(node: &FakeNode, args: &[&str]) -> (i32, String, String) {
    let node_args = node_args(node);
    let mut all: Vec<&str> = node_args.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    run_binary(&all, &[])
}

#[test]
fn list_json_has_exactly_the_documented_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::G5, node_kind()).unwrap();
    let (code, stdout, stderr) = run_on(&node, &["list", "--output", "json"]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_str(&stdout).unwrap();
    assert_eq!(rows.len(), 1);
    let keys: Vec<&str> = rows[0].keys().map(String::as_str).collect();
    let mut expected = vec![
        "id",
        "ibdev",
        "pci_address",
        "uverbs",
        "numa_node",
        "health",
        "cause",
        "reason",
        "cdi_devices",
    ];
    expected.sort();
    let mut keys_sorted = keys.clone();
    keys_sorted.sort();
    assert_eq!(keys_sorted, expected);
    assert_eq!(rows[0]["id"], "rdmap0s28");
    assert_eq!(rows[0]["ibdev"], "rdmap0s28");
    assert_eq!(rows[0]["pci_address"], "0000:00:1c.0");
    assert_eq!(rows[0]["uverbs"], "uverbs0");
    assert_eq!(rows[0]["numa_node"], serde_json::Value::Null);
    assert_eq!(rows[0]["health"], "Healthy");
    assert_eq!(rows[0]["cause"], serde_json::Value::Null);
    assert_eq!(rows[0]["reason"], serde_json::Value::Null);
    assert_eq!(
        rows[0]["cdi_devices"],
        serde_json::json!(["vpc.amazonaws.com/efa=rdmap0s28"])
    );
}

#[test]
fn list_table_shows_pci_identity_and_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let (node, devices) = FakeNode::build(dir.path(), Shape::P4d, node_kind()).unwrap();
    node.remove_node(&devices[1]).unwrap();
    let (code, stdout, _) = run_on(&node, &["list"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    assert!(lines[0].starts_with("ID"));
    assert!(lines[1].contains("0000:10:1b.0") && lines[1].contains("0x1d0f:0xefa1"));
    assert!(
        lines[2].contains("Unhealthy") && lines[2].contains("missing"),
        "{stdout}"
    );
}

/// `list` judges as the running plugin does: an EFA whose admin queue the driver closed is
/// Unhealthy with its reason, in the table and in the JSON, and not with the rule off.
#[test]
fn list_shows_a_closed_admin_queue_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (node, devices) = FakeNode::build(dir.path(), Shape::P4d, node_kind()).unwrap();
    node.set_device_counter(&devices[3], "no_completion_cmds", 3)
        .unwrap();
    let (code, stdout, stderr) = run_on(&node, &["list"]);
    assert_eq!(code, 0, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    assert!(
        lines[4].contains(&devices[3].ibdev)
            && lines[4].contains("Unhealthy")
            && lines[4].contains("the driver closed its admin queue")
            && lines[4].contains("hw_counters/no_completion_cmds is 3"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("Unhealthy").count(), 1, "{stdout}");

    let (code, stdout, stderr) = run_on(&node, &["list", "--output", "json"]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let row = &rows[3];
    assert_eq!(row["ibdev"], devices[3].ibdev.as_str());
    assert_eq!(row["health"], "Unhealthy");
    assert_eq!(row["cause"], "admin_queue_closed");
    let reason = row["reason"].as_str().unwrap();
    assert!(reason.contains("no_completion_cmds is 3"), "{reason}");

    let (code, stdout, _) = run_on(&node, &["--admin-queue-health=false", "list"]);
    assert_eq!(code, 0);
    assert!(!stdout.contains("Unhealthy"), "{stdout}");
}

#[test]
fn list_on_a_node_without_efa_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, _) = run_binary(
        &["--sysfs-root", &dir.path().display().to_string(), "list"],
        &[],
    );
    assert_eq!(code, 0);
    assert!(stdout.contains("no EFA"), "{stdout}");
}

#[test]
fn list_names_the_exclusive_rdma_netns_mode_and_its_fix() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::NoEfa, node_kind()).unwrap();
    let sysfs = node.sysfs.display().to_string();
    let list = || run_binary(&["--sysfs-root", &sysfs, "list"], &[]);
    for mode in [Some("Y"), None] {
        node.set_rdma_netns_mode(mode).unwrap();
        let (code, _, stderr) = list();
        assert_eq!(code, 0);
        assert!(!stderr.contains("exclusive"), "{mode:?}: {stderr}");
    }
    node.set_rdma_netns_mode(Some("N")).unwrap();
    let (code, stdout, stderr) = list();
    assert_eq!(code, 0);
    assert!(stdout.contains("no EFA"), "{stdout}");
    assert!(
        stderr.contains("exclusive network-namespace mode")
            && stderr.contains("rdma system set netns shared"),
        "{stderr}"
    );
}

/// The chart checks its `config` value against the plugin's own file schema: regenerate it
/// with `efa-device-plugin config --schema` when a setting changes.
#[test]
fn the_charts_schema_of_its_config_value_is_the_binarys() {
    let (code, stdout, stderr) = run_binary(&["config", "--schema"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let binary: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/manifests/helm/efa-device-plugin/values.schema.json"
    );
    let chart: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        chart["properties"]["config"], binary,
        "{path}: properties.config differs from `efa-device-plugin config --schema`"
    );
    // Every key the file takes is in it, nested at the dots, and nothing else.
    assert_eq!(binary["additionalProperties"], false);
    assert_eq!(
        binary["properties"]["sharing"]["properties"]["replicas"]["type"],
        "integer"
    );
    assert_eq!(
        binary["properties"]["log-format"]["enum"],
        serde_json::json!(["text", "json"])
    );
    assert!(binary["properties"]["test-only-regular-file-nodes"].is_null());
}

#[cfg(feature = "demo")]
#[test]
fn demo_runs_and_cleans_up() {
    let (code, stdout, stderr) = run_binary(&["demo"], &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("Register: version=v1beta1"));
    assert!(stdout.contains("ListAndWatch: 32 devices"));
    assert!(stdout.contains(r#"NUMA nodes {0}, PCIe roots {"pci0000:4c"}"#));
    assert_eq!(stdout.matches("DeviceSpec host_path=").count(), 4);
    assert!(stdout.contains("is Unhealthy"));
    assert!(stdout.contains("is Healthy again"));
    let scratch = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Done; removed "))
        .expect("scratch dir named")
        .trim_end_matches('.');
    assert!(!Path::new(scratch).exists());
}

#[test]
fn device_ids_default_to_ibdev_and_an_unknown_strategy_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let strategy = |args: &[&str], env: &[(&str, &str)]| {
        let (code, stdout, stderr) = run_binary(&[args, &["config"]].concat(), env);
        assert_eq!(code, 0, "{stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        effective["device-id-strategy"].as_str().unwrap().to_owned()
    };
    assert_eq!(strategy(&[], &[]), "ibdev");
    assert_eq!(strategy(&["--device-id-strategy", "pci"], &[]), "pci");
    assert_eq!(
        strategy(&[], &[("EFA_DP_DEVICE_ID_STRATEGY", "pci")]),
        "pci"
    );
    let config = write_config(dir.path(), "device-id-strategy: pci\n");
    assert_eq!(strategy(&["--config", &config], &[]), "pci");

    let result = run_binary(&["--device-id-strategy", "bdf", "config"], &[]);
    assert_eq!(result.0, 2);
    assert_one_line_error(result, &["--device-id-strategy", "bdf"]);
    let result = run_binary(&["config"], &[("EFA_DP_DEVICE_ID_STRATEGY", "PCI-address")]);
    assert_eq!(result.0, 2);
    assert_one_line_error(result, &["EFA_DP_DEVICE_ID_STRATEGY", "PCI-address"]);
    let config = write_config(dir.path(), "device-id-strategy: uuid\n");
    let result = run_binary(&["--config", &config, "config"], &[]);
    assert_eq!(result.0, 2);
    assert_one_line_error(result, &["device-id-strategy", "uuid"]);
}

#[test]
fn list_shows_both_names_whichever_the_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::P4d, node_kind()).unwrap();
    let rows = |strategy: &str| {
        let (code, stdout, stderr) = run_on(
            &node,
            &["--device-id-strategy", strategy, "list", "--output", "json"],
        );
        assert_eq!(code, 0, "{stderr}");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
        rows
    };
    let by_ibdev = rows("ibdev");
    let by_pci = rows("pci");
    assert_eq!(by_ibdev[0]["id"], "rdmap16s27");
    assert_eq!(by_pci[0]["id"], "0000:10:1b.0");
    for (a, b) in by_ibdev.iter().zip(&by_pci) {
        assert_eq!(
            (&a["ibdev"], &a["pci_address"]),
            (&b["ibdev"], &b["pci_address"])
        );
        assert_eq!(a["id"], a["ibdev"]);
        assert_eq!(b["id"], b["pci_address"]);
    }
    assert_eq!(
        by_pci[0]["cdi_devices"],
        serde_json::json!(["vpc.amazonaws.com/efa=0000:10:1b.0"])
    );
}

/// The DRA guard matches names exactly against the registration sockets, `<driver>-reg.sock`:
/// an empty list, the socket's own name, `DRA.NET` or `dra.net.` were accepted, and the guard
/// was off without a word.
#[test]
fn dra_driver_names_the_guard_cannot_match_are_refused_naming_where_they_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_name = "a DRA driver's name is a lowercase DNS subdomain of at most 63 characters";
    for (bad, problem) in [
        (
            "dra.net-reg.sock",
            "that is a registration socket's name (<driver>-reg.sock); give the driver's name",
        ),
        ("DRA.NET", not_a_name),
        ("dra.net.", not_a_name),
    ] {
        let why = format!("invalid driver name {bad:?}: {problem}");
        assert_refused(
            &["--dra-drivers", bad, "config"],
            &[],
            &format!("error: --dra-drivers: {why}"),
        );
        assert_refused(
            &["config"],
            &[("EFA_DP_DRA_DRIVERS", &format!("dra.net,{bad}"))],
            &format!("error: EFA_DP_DRA_DRIVERS: {why}"),
        );
        let config = write_config(dir.path(), &format!("dra-drivers: [dra.net, \"{bad}\"]\n"));
        assert_refused(
            &["--config", &config, "config"],
            &[],
            &format!("error: config file {config}: dra-drivers: {why}"),
        );
    }
    let none = "no driver names, which would leave the DRA-conflict guard watching for none; \
                name the EFA DRA drivers, or turn the guard off with --allow-dra-coexistence";
    assert_refused(
        &["--dra-drivers", "", "config"],
        &[],
        &format!("error: --dra-drivers: {none}"),
    );
    // A templated variable left empty.
    assert_refused(
        &["config"],
        &[("EFA_DP_DRA_DRIVERS", "")],
        &format!("error: EFA_DP_DRA_DRIVERS: {none}"),
    );
    let config = write_config(dir.path(), "dra-drivers: []\n");
    assert_refused(
        &["--config", &config, "config"],
        &[],
        &format!("error: config file {config}: dra-drivers: {none}"),
    );
}

#[test]
fn the_default_drivers_a_valid_list_and_none_with_coexistence_allowed_are_kept() {
    let drivers = |args: &[&str], env: &[(&str, &str)]| {
        let (code, stdout, stderr) = run_binary(&[args, &["config"]].concat(), env);
        assert_eq!(code, 0, "{args:?} {env:?}: {stderr}");
        let effective: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
        serde_yaml::from_value::<Vec<String>>(effective["dra-drivers"].clone()).unwrap()
    };
    assert_eq!(
        drivers(&[], &[]),
        ["dra.net", "dra.networking.k8s.aws"],
        "the defaults"
    );
    assert_eq!(
        drivers(&["--dra-drivers", "dra.net, efa-dra.example.com"], &[]),
        ["dra.net", "efa-dra.example.com"]
    );
    // With the guard off, no driver needs naming.
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "dra-drivers: []\nallow-dra-coexistence: true\n");
    assert!(drivers(&["--config", &config], &[]).is_empty());
    let env = [
        ("EFA_DP_DRA_DRIVERS", ""),
        ("EFA_DP_ALLOW_DRA_COEXISTENCE", "true"),
    ];
    assert!(drivers(&[], &env).is_empty());
}

#[test]
fn list_names_a_registered_dra_driver_and_what_to_check() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::P4d, node_kind()).unwrap();
    let registry = dir.path().join("plugins_registry");
    std::fs::create_dir(&registry).unwrap();
    let registry_arg = registry.display().to_string();
    let list = |extra: &[&str]| {
        let mut args = vec!["--plugins-registry-dir", &registry_arg];
        args.extend(extra);
        args.push("list");
        run_on(&node, &args)
    };
    let (code, stdout, stderr) = list(&[]);
    assert_eq!(code, 0);
    assert!(!stderr.contains("DRA"), "{stderr}");
    assert_eq!(stdout.matches("Healthy").count(), 4, "{stdout}");

    let _dranet =
        std::os::unix::net::UnixListener::bind(registry.join("dra.net-reg.sock")).unwrap();
    let (code, stdout, stderr) = list(&[]);
    assert_eq!(code, 0);
    assert!(
        stderr.starts_with("warning: DRA driver dra.net is registered")
            && stderr
                .contains("DeviceClass whose spec.extendedResourceName is vpc.amazonaws.com/efa")
            && stderr.contains("kubectl get deviceclasses"),
        "{stderr}"
    );
    assert_eq!(
        stdout.matches("Unhealthy").count(),
        4,
        "withheld, as advertised: {stdout}"
    );

    let (_, stdout, stderr) = list(&["--allow-dra-coexistence"]);
    assert!(!stderr.contains("DRA"), "{stderr}");
    assert_eq!(stdout.matches("Unhealthy").count(), 0, "{stdout}");
}

/// `list` writes its warnings as `main` writes its own lines: a closed stderr loses them, not
/// the listing or the exit status (`eprintln!` would panic, and the release build abort).
#[test]
fn list_with_a_closed_stderr_still_lists_and_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::P4d, node_kind()).unwrap();
    let registry = dir.path().join("plugins_registry");
    std::fs::create_dir(&registry).unwrap();
    // A registered DRA driver: something `list` warns about.
    let _dranet =
        std::os::unix::net::UnixListener::bind(registry.join("dra.net-reg.sock")).unwrap();
    let mut args = node_args(&node);
    args.extend([
        "--plugins-registry-dir".to_owned(),
        registry.display().to_string(),
    ]);
    args.push("list".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (closed, stderr) = std::io::pipe().unwrap();
    drop(closed);
    let output = binary_command(&args, &[]).stderr(stderr).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert_eq!(
        stdout.matches("DRA driver dra.net is registered").count(),
        4,
        "every EFA listed, withheld: {stdout}"
    );
}

#[test]
fn the_kubelets_socket_or_the_plugins_own_is_refused_as_a_competitor() {
    let dir = tempfile::tempdir().unwrap();
    for (name, problem) in [
        ("kubelet.sock", "the kubelet's registration socket"),
        ("efa-device-plugin.sock", "this plugin's own socket"),
    ] {
        let listed = format!("aws-efa-device-plugin.sock, {name}");
        assert_one_line_error(
            run_binary(&["--competing-plugin-sockets", &listed, "config"], &[]),
            &["--competing-plugin-sockets", name, problem],
        );
        assert_one_line_error(
            run_binary(
                &["config"],
                &[("EFA_DP_COMPETING_PLUGIN_SOCKETS", listed.as_str())],
            ),
            &["EFA_DP_COMPETING_PLUGIN_SOCKETS", name, problem],
        );
        let config = write_config(dir.path(), &format!("competing-plugin-sockets: [{name}]\n"));
        assert_one_line_error(
            run_binary(&["--config", &config, "config"], &[]),
            &[&config, "competing-plugin-sockets", name, problem],
        );
    }
}

/// Driver 3.3.0's `0xefa4` devices at 1600 Gb/s: found, healthy and shown with their ID.
#[test]
fn list_shows_driver_3_3_efa4_devices() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _) = FakeNode::build(dir.path(), Shape::P6B300Efa4, node_kind()).unwrap();
    let (code, stdout, stderr) = run_on(&node, &["list"]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Vec<&str> = stdout.lines().skip(1).collect();
    assert_eq!(rows.len(), 16, "{stdout}");
    assert!(
        rows.iter()
            .all(|r| r.contains("0x1d0f:0xefa4") && r.contains("Healthy")),
        "{stdout}"
    );
}
