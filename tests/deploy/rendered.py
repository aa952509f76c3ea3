"""Reading rendered manifests: what the drift and render comparisons share."""

import yaml

PLUGIN_CONTAINER = "efa-device-plugin"
CONFIG_KEY = "config.yaml"


def load(path):
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one(docs, kind):
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind}, found {len(found)}")
    return found[0]


def plugin_configmap(docs):
    """The ConfigMap holding the plugin's config file; others (the dashboard's) may be rendered too."""
    found = [d for d in docs if d.get("kind") == "ConfigMap" and CONFIG_KEY in (d.get("data") or {})]
    if len(found) != 1:
        raise AssertionError(f"expected one ConfigMap holding {CONFIG_KEY}, found {len(found)}")
    return found[0]


def plugin_container(daemonset):
    for c in daemonset["spec"]["template"]["spec"]["containers"]:
        if c["name"] == PLUGIN_CONTAINER:
            return c
    raise AssertionError(f"no container named {PLUGIN_CONTAINER}")


def plugin_config(configmap):
    """The plugin's config file as data, so formatting differences don't count."""
    return yaml.safe_load(configmap["data"][CONFIG_KEY])


def report(checks, summary):
    """Prints each failed check and a summary line; returns the exit status."""
    for what, ok in checks.items():
        if not ok:
            print(f"not ok - {what}")
    failed = sum(not ok for ok in checks.values())
    print(f"{len(checks)} {summary}, {failed} failed")
    return 1 if failed else 0
