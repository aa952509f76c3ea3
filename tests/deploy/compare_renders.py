"""Checks that `helm template` with default values renders what the plain
manifests hold, so the two install paths cannot diverge unnoticed.

Ignored, by design: the labels only Helm adds (helm.sh/chart,
app.kubernetes.io/managed-by), and the checksum/config pod annotation with
which Helm rolls the pods when the config changes. The config file is compared
as data, since Helm re-serialises it with sorted keys.
"""

import sys

import rendered

HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by"}
HELM_ONLY_POD_ANNOTATIONS = {"checksum/config"}


def normalise(doc):
    meta = doc["metadata"]
    for label in HELM_ONLY_LABELS:
        meta.get("labels", {}).pop(label, None)
    if doc["kind"] == "DaemonSet":
        annotations = doc["spec"]["template"]["metadata"].get("annotations", {})
        for key in HELM_ONLY_POD_ANNOTATIONS:
            annotations.pop(key, None)
    if doc["kind"] == "ConfigMap":
        doc["data"][rendered.CONFIG_KEY] = rendered.plugin_config(doc)
    return (doc["kind"], meta.get("namespace"), meta["name"]), doc


def differences(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}"
            if key not in a:
                yield f"{where}: only in helm"
            elif key not in b:
                yield f"{where}: only in plain"
            else:
                yield from differences(a[key], b[key], where)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield f"{path}: plain {a!r} != helm {b!r}"


def main(plain_path, helm_path):
    plain = dict(normalise(d) for d in rendered.load(plain_path))
    helm = dict(normalise(d) for d in rendered.load(helm_path))
    problems = [f"{'/'.join(map(str, k))}: only in plain" for k in plain.keys() - helm.keys()]
    problems += [f"{'/'.join(map(str, k))}: only in helm" for k in helm.keys() - plain.keys()]
    for key in sorted(plain.keys() & helm.keys(), key=str):
        problems += [f"{'/'.join(map(str, key))}{d}" for d in differences(plain[key], helm[key])]
    for p in problems:
        print(p)
    print(f"{len(plain)} objects compared, {len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
