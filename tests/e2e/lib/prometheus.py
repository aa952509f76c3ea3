"""The cluster suite's side of a real Prometheus: what to ask it, read from the
files users get (the README's metrics table and PromQL examples, the
dashboard's panels), and its HTTP API.

usage:
  prometheus.py families README            metric families the README lists
  prometheus.py examples README            the README's PromQL examples
  prometheus.py panels DASHBOARD.json      "panel title<TAB>query" per query,
                                           with Grafana's variables filled in
  prometheus.py rules RENDERED.yaml        the PrometheusRule's groups, as a
                                           Prometheus rules file
  prometheus.py query URL EXPR             the result, one sample per line;
                                           exit 1 when there is none
  prometheus.py targets URL JOB            "health scrapeUrl lastError" of the
                                           job's active targets
  prometheus.py alert URL NAME LABEL=VALUE the state of that alert: firing,
                                           pending or inactive
"""

import json
import re
import sys
import urllib.parse
import urllib.request

import yaml

# Grafana's variables, as the dashboard would fill them on a 6h view: every
# node, and a rate window that spans several scrapes.
GRAFANA_VARIABLES = {"$node": ".*", "$__rate_interval": "5m"}


def readme_section(text, heading):
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def families(readme):
    """Each backticked metric name in the first column of the Metrics table;
    `efa_<counter>_total` stands for every hardware counter, so the concrete
    names in its row are the families."""
    section = readme_section(readme, "### Metrics")
    names = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) < 4 or not cells[0].startswith("`efa"):
            continue
        name = cells[0].strip("`")
        if "<" in name:
            names += re.findall(r"`(efa_[a-z_]+_total)`", cells[3])
        else:
            names.append(name)
    return names


def examples(readme):
    """The queries of every ```promql block: the lines that are not comments."""
    queries = []
    for block in re.findall(r"```promql\n(.*?)```", readme, re.S):
        queries += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return queries


def panels(dashboard):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            yield panel["title"], expr


def api(url, path, **params):
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=10) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body}")
    return body["data"]


def main(command, *args):
    if command in ("families", "examples"):
        with open(args[0], encoding="utf-8") as f:
            print("\n".join({"families": families, "examples": examples}[command](f.read())))
    elif command == "panels":
        with open(args[0], encoding="utf-8") as f:
            for title, expr in panels(json.load(f)):
                print(f"{title}\t{expr}")
    elif command == "rules":
        with open(args[0], encoding="utf-8") as f:
            rule = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "PrometheusRule")
        yaml.safe_dump(rule["spec"], sys.stdout, sort_keys=False, width=1000)
    elif command == "query":
        result = api(args[0], "/api/v1/query", query=args[1])["result"]
        for sample in result:
            print(json.dumps(sample["metric"], sort_keys=True), sample["value"][1])
        return 0 if result else 1
    elif command == "targets":
        for target in api(args[0], "/api/v1/targets", state="active")["activeTargets"]:
            if target["labels"].get("job") == args[1]:
                print(target["health"], target["scrapeUrl"], target["lastError"] or "-")
    elif command == "alert":
        name, (label, value) = args[1], args[2].split("=", 1)
        states = [a["state"] for a in api(args[0], "/api/v1/alerts")["alerts"]
                  if a["labels"].get("alertname") == name and a["labels"].get(label) == value]
        print(states[0] if states else "inactive")
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
