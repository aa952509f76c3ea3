"""What the cluster suite checks about the plugin's pod spec.

compare SHIPPED TEST      TEST (the test overlay or values, rendered) differs
                          from SHIPPED (the same install as users get it) only
                          by the image and the fake sysfs tree; prints the
                          first other difference and exits 1
security-context          reads rendered manifests or a Pod's JSON on stdin and
                          prints the plugin's pod and container securityContext
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy"))
import rendered  # noqa: E402

# What the test overlay and values add, and nothing else may differ.
SYSFS_VOLUME = "e2e-sysfs"
SYSFS_ARG = "--sysfs-root=/e2e-sysfs"


def without_test_additions(daemonset):
    pod = daemonset["spec"]["template"]["spec"]
    container = rendered.plugin_container(daemonset)
    added = (
        [v for v in pod["volumes"] if v["name"] == SYSFS_VOLUME],
        [m for m in container["volumeMounts"] if m["name"] == SYSFS_VOLUME],
        [a for a in container["args"] if a == SYSFS_ARG],
    )
    if any(len(found) != 1 for found in added):
        raise AssertionError(f"the test install must add exactly one {SYSFS_VOLUME} volume, mount and {SYSFS_ARG}")
    pod["volumes"].remove(added[0][0])
    container["volumeMounts"].remove(added[1][0])
    container["args"].remove(SYSFS_ARG)
    container.pop("image")


def first_difference(a, b, path=""):
    if type(a) is not type(b):
        return path or "/"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}"
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path} (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}")
            if found:
                return found
        return None
    return None if a == b else path


def compare(shipped_path, test_path):
    shipped = {(d["kind"], d["metadata"]["name"]): d for d in rendered.load(shipped_path)}
    test = {(d["kind"], d["metadata"]["name"]): d for d in rendered.load(test_path)}
    if shipped.keys() != test.keys():
        print(f"objects differ: shipped {sorted(shipped)}, test {sorted(test)}")
        return 1
    for key, doc in test.items():
        want = shipped[key]
        if key[0] == "DaemonSet":
            without_test_additions(doc)
            rendered.plugin_container(want).pop("image")
        where = first_difference(want, doc)
        if where:
            print(f"the test {key[0]}/{key[1]} differs from the shipped one at {where}")
            return 1
    return 0


def security_context():
    text = sys.stdin.read()
    try:
        spec = json.loads(text)["spec"]
        container = next(c for c in spec["containers"] if c["name"] == rendered.PLUGIN_CONTAINER)
    except json.JSONDecodeError:
        import yaml

        daemonset = rendered.one([d for d in yaml.safe_load_all(text) if d], "DaemonSet")
        spec = daemonset["spec"]["template"]["spec"]
        container = rendered.plugin_container(daemonset)
    print(json.dumps({"pod": spec.get("securityContext"), "container": container.get("securityContext")}, sort_keys=True))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    sys.exit(security_context())
