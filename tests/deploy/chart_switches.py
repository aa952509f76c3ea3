"""Checks that each chart switch set in values-variant.yaml changes what it
says it changes; the default rendering is covered by compare_renders.py.

usage: chart_switches.py VALUES.yaml RENDERED.yaml
"""

import sys

import rendered


def main(values_path, rendered_path):
    values = rendered.load(values_path)[0]
    docs = rendered.load(rendered_path)
    ds = rendered.one(docs, "DaemonSet")
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    container = rendered.plugin_container(ds)
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    expressions = [e for term in terms for e in term["matchExpressions"]]
    kinds = {d["kind"] for d in docs}
    names = {d["metadata"]["name"] for d in docs}
    plugin_configs = [d for d in docs if d["kind"] == "ConfigMap" and rendered.CONFIG_KEY in d["data"]]
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and d not in plugin_configs]
    rule = values["prometheusRule"]
    alerts = [r for g in rendered.one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]] if (
        "PrometheusRule" in kinds) else []

    expectations = {
        "fullnameOverride names every object": all(
            n == values["fullnameOverride"] or n.startswith(values["fullnameOverride"] + "-") for n in names
        ),
        "labelled scope adds the opt-in label term": {
            "key": "efa-device-plugin/enabled", "operator": "In", "values": ["true"]
        } in expressions,
        "labelled scope keeps the Auto Mode exclusion": any(
            e["key"] == "eks.amazonaws.com/compute-type" and e["operator"] == "NotIn" for e in expressions
        ),
        "labelled scope keeps node-mode nodes out": {
            "key": "efa-device-plugin/node-mode", "operator": "DoesNotExist"
        } in expressions,
        "nodeSelector is passed through": spec.get("nodeSelector") == values["nodeSelector"],
        "tolerations add to CriticalAddonsOnly": spec["tolerations"][0]["key"] == "CriticalAddonsOnly"
        and spec["tolerations"][1:] == values["tolerations"],
        "imagePullSecrets are passed through": spec.get("imagePullSecrets") == values["imagePullSecrets"],
        "image.tag may carry a digest": container["image"].endswith(values["image"]["tag"]),
        "additionalPodLabels are added": values["additionalPodLabels"].items() <= pod["metadata"]["labels"].items(),
        "additionalPodAnnotations are added": values["additionalPodAnnotations"].items()
        <= pod["metadata"]["annotations"].items(),
        "metrics.host and .port form the listen address": f"--metrics-address=[::]:{values['metrics']['port']}"
        in container["args"],
        "podMonitor renders and scrapes the metrics port": "PodMonitor" in kinds
        and rendered.one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics",
        "nfd.enabled passes the feature file under featuresDir": f"--nfd-features-file={values['nfd']['featuresDir']}/efa"
        in container["args"],
        "cdi.enabled passes the strategy and specDir": {
            "--device-list-strategy=cdi",
            f"--cdi-spec-dir={values['cdi']['specDir']}",
        }
        <= set(container["args"]),
        "cdi.enabled mounts specDir read-write": any(
            m["mountPath"] == values["cdi"]["specDir"] and not m.get("readOnly") for m in container["volumeMounts"]
        ),
        "networkPolicy can be turned off": "NetworkPolicy" not in kinds,
        "extraArgs come last": container["args"][-len(values["extraArgs"]):] == values["extraArgs"],
        "extraVolumes and extraVolumeMounts are added": spec["volumes"][-1] == values["extraVolumes"][0]
        and container["volumeMounts"][-1] == values["extraVolumeMounts"][0],
        "config values reach the ConfigMap": len(plugin_configs) == 1
        and values["config"].items() <= rendered.plugin_config(plugin_configs[0]).items(),
        "prometheusRule renders with its labels": rule["labels"].items()
        <= rendered.one(docs, "PrometheusRule")["metadata"]["labels"].items(),
        "prometheusRule.for is the for of every alert that has one": {a.get("for") for a in alerts}
        == {rule["for"], None},
        "prometheusRule.window and greyFailureRate reach the counter alerts": all(
            f"[{rule['window']}]" in a["expr"] for a in alerts if "_total[" in a["expr"]
        ) and any(a["expr"].endswith(f"> {rule['greyFailureRate']}") for a in alerts),
        "prometheusRule.runbookUrl starts every runbook_url": all(
            a["annotations"]["runbook_url"].startswith(rule["runbookUrl"] + "#alert-") for a in alerts
        ) and len(alerts) > 0,
        "dashboard renders in dashboard.namespace with its labels and annotations": len(dashboards) == 1
        and dashboards[0]["metadata"]["namespace"] == values["dashboard"]["namespace"]
        and values["dashboard"]["labels"].items() <= dashboards[0]["metadata"]["labels"].items()
        and dashboards[0]["metadata"]["annotations"] == values["dashboard"]["annotations"],
    }
    return rendered.report(expectations, "chart switches checked")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
