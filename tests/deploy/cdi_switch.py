"""Checks that turning CDI on (the chart's cdi.enabled, the kustomize component
manifests/components/cdi) changes exactly what it should: the plugin gets
--device-list-strategy=cdi and --cdi-spec-dir before its subcommand, and one
read-write hostPath mount of that dir. Everything else in the rendering stays
as it is, and the spec dir is the only writable host path besides the
kubelet's device-plugin dir.

usage: cdi_switch.py OFF.yaml ON.yaml
"""

import copy
import sys

import rendered

SPEC_DIR = "/var/run/cdi"
ARGS = ["--device-list-strategy=cdi", f"--cdi-spec-dir={SPEC_DIR}"]
WRITABLE_HOST_PATHS = {"/var/lib/kubelet/device-plugins", SPEC_DIR}


def writable_host_paths(ds):
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    container = rendered.plugin_container(ds)
    return {
        volumes[m["name"]]["hostPath"]["path"]
        for m in container["volumeMounts"]
        if not m.get("readOnly") and "hostPath" in volumes[m["name"]]
    }


def main(off_path, on_path):
    off = rendered.load(off_path)
    on = rendered.load(on_path)
    off_ds, on_ds = rendered.one(off, "DaemonSet"), rendered.one(on, "DaemonSet")
    expected = copy.deepcopy(off_ds)
    container = rendered.plugin_container(expected)
    container["args"][-1:-1] = ARGS
    container["volumeMounts"].append({"name": "cdi-specs", "mountPath": SPEC_DIR})
    expected["spec"]["template"]["spec"]["volumes"].append(
        {"name": "cdi-specs", "hostPath": {"path": SPEC_DIR, "type": "DirectoryOrCreate"}}
    )
    # Helm rolls the pods on a config change; the config itself must not change.
    for ds in (expected, on_ds):
        ds["spec"]["template"]["metadata"].get("annotations", {}).pop("checksum/config", None)
    others_off = [d for d in off if d["kind"] != "DaemonSet"]
    others_on = [d for d in on if d["kind"] != "DaemonSet"]
    checks = {
        "only the args, mount and volume for the spec dir are added": on_ds == expected,
        "every other object is unchanged": others_off == others_on,
        f"the writable host paths are {sorted(WRITABLE_HOST_PATHS)}": writable_host_paths(on_ds) == WRITABLE_HOST_PATHS,
    }
    return rendered.report(checks, "CDI switch checks")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
