"""Structural checks of the Grafana dashboard, which no Grafana renders here:
the schema version, a Prometheus datasource variable that every panel and
query uses (so no datasource UID is hard-coded), unique panel ids, a query in
every panel; and that the chart's ConfigMap ships the file unchanged, labelled
for the Grafana sidecar.

usage: dashboard_check.py DASHBOARD.json [RENDERED.yaml]
"""

import json
import sys

import rendered

# Grafana 10.4 and later read schema 39 as it is.
MIN_SCHEMA_VERSION = 39
DATASOURCE = "${datasource}"


def panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def datasource_refs(node, path="$"):
    """Every `datasource` value in the dashboard, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield path, value
            else:
                yield from datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from datasource_refs(value, f"{path}[{i}]")


def main(dashboard_path, rendered_path=None):
    with open(dashboard_path, encoding="utf-8") as f:
        text = f.read()
    dashboard = json.loads(text)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in panels(dashboard)]
    refs = list(datasource_refs(dashboard))
    hard_coded = [path for path, ref in refs if not (isinstance(ref, dict) and ref.get("uid") == DATASOURCE)]
    checks = {
        f"schemaVersion is at least {MIN_SCHEMA_VERSION}": dashboard.get("schemaVersion", 0) >= MIN_SCHEMA_VERSION,
        "a uid and a title": bool(dashboard.get("uid")) and bool(dashboard.get("title")),
        "a Prometheus datasource variable": variables.get("datasource", {}).get("type") == "datasource"
        and variables["datasource"].get("query") == "prometheus",
        "no datasource UID is hard-coded: " + ", ".join(hard_coded): not hard_coded,
        "every panel names the datasource": all("datasource" in p for p in panels(dashboard)),
        "panel ids are unique": len(ids) == len(set(ids)),
        "every panel has a query": all(p.get("targets") and all(t.get("expr") for t in p["targets"])
                                       for p in panels(dashboard)),
        "query refIds are unique within each panel": all(
            len({t["refId"] for t in p["targets"]}) == len(p["targets"]) for p in panels(dashboard)
        ),
    }
    if rendered_path:
        maps = [d for d in rendered.load(rendered_path)
                if d.get("kind") == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
        checks["the chart's dashboard ConfigMap carries grafana_dashboard: \"1\""] = len(maps) == 1
        checks["the ConfigMap holds the file unchanged"] = len(maps) == 1 and list(maps[0]["data"].values()) == [text]
    return rendered.report(checks, "dashboard checks")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
