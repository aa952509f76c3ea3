"""Checks the rendered manifests against the real binary, so a renamed flag, a
changed default or a new path the plugin reads cannot ship with a manifest
that no longer fits it.

For each rendering it asks the binary itself: every arg must be a flag that
`--help` lists, the args plus the ConfigMap's config file must parse
(`efa-device-plugin ... config` prints the merged result), every path the
plugin uses must be mounted from the host location the kubelet or kernel puts
it at, and the metrics address must match the port that the probes and
scrape annotations use. It also checks that every place naming the release
version agrees with Cargo.toml.

usage: drift_check.py BINARY REPO_ROOT RENDERED.yaml...
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import PurePosixPath

import yaml

import rendered

# Which options are paths comes from the binary's settings table
# (`efa-device-plugin settings`); what is known here is where the kubelet or the
# kernel puts each on the host, which the binary cannot know. For each path
# option: (part under the option, host path, whether the plugin writes there).
HOST_LOCATIONS = {
    "device-plugin-dir": ("", "/var/lib/kubelet/device-plugins", True),
    "pod-resources-socket": ("", "/var/lib/kubelet/pod-resources/kubelet.sock", False),
    "plugins-registry-dir": ("", "/var/lib/kubelet/plugins_registry", False),
    "dev-root": ("infiniband", "/dev/infiniband", False),
    "sysfs-root": ("", "/sys", False),
}
# A path option without a default names a file that others read on the host,
# at the same path; the plugin writes it, and an empty value turns the feature
# off (e.g. nfd-features-file).
# Paths the plugin uses only under one setting: option -> (setting, value,
# host path it must be mounted from, whether the plugin writes there). The CDI
# spec dir is where the runtime looks for specs.
CONDITIONAL_LOCATIONS = {
    "cdi-spec-dir": ("device-list-strategy", "cdi", "/var/run/cdi", True),
}
# The plugin hands {dev-root}/infiniband/uverbsN to the kubelet as the host
# path of an allocated device, so the container must see it at the host's path.
SAME_PATH_AS_HOST = {"dev-root"}
# Flags for simulated nodes in tests (e.g. regular files as device nodes).
TEST_ONLY = "test-only-"
# A container sees the host's sysfs, read-only, without any mount.
CONTAINER_OWN = {"/sys"}


class Checks:
    def __init__(self):
        self.total = self.failures = 0

    def expect(self, ok, what):
        self.total += 1
        if not ok:
            self.failures += 1
            print(f"not ok - {what}")


def run(binary, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFA_DP_")}
    return subprocess.run([binary, *args], capture_output=True, text=True, env=env, check=False)


def path_options(binary):
    """The binary's path options, split into those with a default and the
    shared files, which have none; `--config` is checked on its own."""
    result = run(binary, "settings", "--output", "json")
    rows = json.loads(result.stdout) if result.returncode == 0 else []
    paths = [row for row in rows if row["path"] and row["flag"] != "config"]
    return {row["flag"] for row in paths if row["default"]}, {row["flag"] for row in paths if not row["default"]}


def check_path_options(checks, located, shared):
    """Every path option of the binary has its host location here, and every
    location here is an option of the binary, so neither can be renamed or
    added alone."""
    checks.expect(located or shared, "the binary lists its path options (settings --output json)")
    known = set(HOST_LOCATIONS) | set(CONDITIONAL_LOCATIONS)
    for option in sorted(located - known):
        checks.expect(False, f"--{option} is a path of the binary with no host location in drift_check.py")
    for option in sorted(known - located):
        checks.expect(False, f"--{option} has a host location in drift_check.py but is no path option of the binary")


def help_surface(binary):
    """The long flags and subcommands that the binary's --help lists."""
    text = run(binary, "--help").stdout
    flags = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", text))
    commands, in_commands = set(), False
    for line in text.splitlines():
        if line.strip().endswith(":"):
            in_commands = line.strip().lower() == "commands:"
        elif in_commands and (m := re.match(r"\s+([a-z][a-z0-9-]*)(\s|$)", line)):
            commands.add(m.group(1))
    return flags, commands


def split_args(args):
    """`--flag=value` pairs and the trailing subcommand."""
    options, command = {}, None
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            options[name] = value
        else:
            command = arg
    return options, command


def mount_for(container, volumes, path):
    """The volume mount that holds `path`, the deepest if mounts nest."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = PurePosixPath(m["mountPath"])
        if PurePosixPath(path) == mp or mp in PurePosixPath(path).parents:
            if best is None or len(mp.parts) > len(PurePosixPath(best["mountPath"]).parts):
                best = m
    return best, (volumes.get(best["name"]) if best else None)


def host_path_of(mount, volume, path):
    rest = PurePosixPath(path).relative_to(mount["mountPath"])
    return str(PurePosixPath(volume["hostPath"]["path"]) / rest)


def check_rendering(checks, binary, flags, commands, paths, path):
    docs = rendered.load(path)
    ds = rendered.one(docs, "DaemonSet")
    cm = rendered.plugin_configmap(docs)
    pod = ds["spec"]["template"]
    container = rendered.plugin_container(ds)
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    options, command = split_args(container.get("args", []))
    name = os.path.basename(path)

    for flag in options:
        checks.expect(flag in flags, f"{name}: --{flag} is a flag of the binary")
        checks.expect(not flag.startswith(TEST_ONLY), f"{name}: --{flag} is for tests, never for a node")
    checks.expect(command in commands, f"{name}: subcommand {command!r} is one the binary has")

    config_path = options.get("config", "")
    mount, volume = mount_for(container, volumes, config_path)
    checks.expect(
        volume is not None
        and volume.get("configMap", {}).get("name") == cm["metadata"]["name"]
        and PurePosixPath(config_path).name == rendered.CONFIG_KEY,
        f"{name}: --config={config_path} is the ConfigMap's {rendered.CONFIG_KEY}",
    )

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(cm["data"][rendered.CONFIG_KEY])
        f.flush()
        args = [f"--{k}={f.name if k == 'config' else v}" for k, v in options.items()]
        result = run(binary, *args, "config")
    checks.expect(result.returncode == 0, f"{name}: the binary accepts the args and config ({result.stderr.strip()})")
    if result.returncode != 0:
        return
    effective = yaml.safe_load(result.stdout)
    checks.expect(
        not any(key.startswith(TEST_ONLY) for key in effective),
        f"{name}: no test-only setting is on",
    )

    for key, value in rendered.plugin_config(cm).items():
        checks.expect(
            str(effective.get(key)) == str(value),
            f"{name}: config {key}={value!r} takes effect (binary has {effective.get(key)!r})",
        )

    used_volumes = {mount["name"]} if mount else set()
    located, shared = paths
    locations = {o: HOST_LOCATIONS[o] for o in located if o in HOST_LOCATIONS}
    locations.update({o: ("", effective[o], True) for o in shared if effective.get(o)})
    locations.update(
        {
            o: ("", host, writes)
            for o, (setting, value, host, writes) in CONDITIONAL_LOCATIONS.items()
            if o in located and effective.get(setting) == value
        }
    )
    for option, (part, host, writes) in locations.items():
        value = effective.get(option)
        checks.expect(value is not None, f"{name}: the binary reports {option}")
        if value is None:
            continue
        used = str(PurePosixPath(value) / part)
        if option in SAME_PATH_AS_HOST:
            checks.expect(used == host, f"{name}: {option} puts {used} at the host's path {host}")
        mount, volume = mount_for(container, volumes, used)
        if mount is None:
            checks.expect(used == host and host in CONTAINER_OWN, f"{name}: {option} uses {used}, the host's {host}")
            continue
        used_volumes.add(mount["name"])
        seen = host_path_of(mount, volume, used) if "hostPath" in volume else None
        checks.expect(seen == host, f"{name}: {option} uses {used}, the host's {host} (mounted from {seen})")
        checks.expect(
            bool(mount.get("readOnly")) != writes,
            f"{name}: {used} is mounted {'read-write' if writes else 'read-only'}",
        )
    for vname, v in volumes.items():
        checks.expect(vname in used_volumes, f"{name}: volume {vname} backs a path the plugin uses")

    address = effective.get("metrics-address", "")
    port = int(address.rsplit(":", 1)[1]) if ":" in address else None
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    checks.expect(port is not None and ports.get("metrics") == port, f"{name}: metrics-address {address} is the metrics port {ports.get('metrics')}")
    for probe, endpoint in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container.get(probe, {}).get("httpGet", {})
        checks.expect(get.get("path") == endpoint and get.get("port") in ("metrics", port), f"{name}: {probe} asks {endpoint} on the metrics port")
    annotations = pod["metadata"].get("annotations", {})
    checks.expect(
        annotations.get("prometheus.io/port") == str(port) and annotations.get("prometheus.io/path") == "/metrics",
        f"{name}: scrape annotations point at {port}/metrics",
    )


def check_versions(checks, repo, renderings):
    with open(os.path.join(repo, "Cargo.toml"), "rb") as f:
        package = tomllib.load(f)["package"]
    version = package["version"]
    with open(os.path.join(repo, "manifests/helm/efa-device-plugin/Chart.yaml"), encoding="utf-8") as f:
        checks.expect(str(yaml.safe_load(f)["appVersion"]) == version, f"Chart appVersion is {version}")
    with open(os.path.join(repo, "Dockerfile"), encoding="utf-8") as f:
        dockerfile = f.read()
    arg = re.search(r"^ARG VERSION=(\S+)", dockerfile, re.M)
    checks.expect(arg is not None and arg.group(1) == version, f"Dockerfile ARG VERSION is {version}")
    # rust-version names the toolchain CI builds with, so the image is built with it too.
    rust = re.search(r"^ARG RUST_VERSION=(\S+)", dockerfile, re.M)
    toolchain = package["rust-version"]
    checks.expect(rust is not None and rust.group(1) == toolchain, f"Dockerfile ARG RUST_VERSION is {toolchain}")
    for path in renderings:
        ds = rendered.one(rendered.load(path), "DaemonSet")
        image = rendered.plugin_container(ds)["image"]
        tag = image.partition("@")[0].rpartition(":")[2]
        checks.expect(tag == version, f"{os.path.basename(path)}: image {image} is version {version}")


def main(binary, repo, *renderings):
    if not os.access(binary, os.X_OK):
        print(f"no binary to check against at {binary}")
        return 1
    checks = Checks()
    flags, commands = help_surface(binary)
    checks.expect("config" in commands, "the binary has the config subcommand")
    paths = path_options(binary)
    check_path_options(checks, *paths)
    for path in renderings:
        check_rendering(checks, binary, flags, commands, paths, path)
    check_versions(checks, repo, renderings)
    print(f"{checks.total} drift checks, {checks.failures} failed")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
