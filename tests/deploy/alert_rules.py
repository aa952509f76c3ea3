"""Keeps the plain alert rules file and the kustomize component equal to the
chart's PrometheusRule rendered with default values, the one place the rules
are written.

usage: alert_rules.py RENDERED.yaml RULES_FILE COMPONENT_FILE [--write]

RENDERED.yaml is `helm template efa-device-plugin CHART --namespace kube-system
--set prometheusRule.enabled=true --show-only templates/prometheusrule.yaml`.
Without --write, exits 1 naming each file that differs; with it, rewrites them.
"""

import sys

import yaml

import rendered
from compare_renders import HELM_ONLY_LABELS

GENERATED = (
    "# Generated from the chart's templates/prometheusrule.yaml with default values by\n"
    "# tests/deploy/alert_rules.py; edit the template and run it with --write.\n"
)


def expected(render_path):
    rule = rendered.one(rendered.load(render_path), "PrometheusRule")
    for label in HELM_ONLY_LABELS:
        rule["metadata"]["labels"].pop(label, None)
    return {"rules": rule["spec"], "component": rule}


def main(render_path, rules_path, component_path, *flags):
    want = expected(render_path)
    paths = {"rules": rules_path, "component": component_path}
    stale = []
    for key, path in paths.items():
        if "--write" in flags:
            with open(path, "w", encoding="utf-8") as f:
                f.write(GENERATED)
                yaml.safe_dump(want[key], f, sort_keys=False, width=1000)
        elif rendered.load(path) != [want[key]]:
            stale.append(path)
    for path in stale:
        print(f"{path} differs from the chart's PrometheusRule; run tests/deploy/alert_rules.py with --write")
    print(f"{len(paths)} files compared with the chart's rules, {len(stale)} differ")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
