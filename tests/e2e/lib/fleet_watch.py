"""The samples of cluster/fleet.sh's watch_fleet, about one a second:
"TIME NODE READY ALLOCATABLE" per node, READY 1 while a plugin pod on NODE is
Ready and not terminating, ALLOCATABLE "-" when the node has none.

sample RESOURCE
    Reads `kubectl get nodes,pods -o json` (the plugins' namespace) on stdin
    and prints one sample: a line per node, ALLOCATABLE RESOURCE's.
rollout FILE NODE=COUNT... BOUND
    Passes when no sample has two of the NODEs without a plugin, and each NODE
    has COUNT allocatable (0: none or 0) within BOUND seconds of its plugin
    being Ready again and at the end. Prints each NODE's time without a plugin
    (from its first sample without one to its first with one again), their
    median and maximum, and the samples; otherwise prints why it fails and
    exits 1.
steady FILE NODE=COUNT
    Passes when NODE has COUNT allocatable in every sample, and prints how
    many there are; otherwise prints the values NODE had ("absent" for a
    sample without NODE) and exits 1.
"""

import json
import statistics
import sys
import time
from collections import defaultdict

PLUGIN_LABEL = ("app.kubernetes.io/name", "efa-device-plugin")


def sample(resource):
    items = json.load(sys.stdin)["items"]
    pods = [i for i in items if i["kind"] == "Pod" and i["metadata"].get("labels", {}).get(PLUGIN_LABEL[0]) == PLUGIN_LABEL[1]]
    ready = {p["spec"].get("nodeName") for p in pods
             if not p["metadata"].get("deletionTimestamp")
             and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}
    now = time.time()
    for n in (i for i in items if i["kind"] == "Node"):
        name = n["metadata"]["name"]
        alloc = n["status"].get("allocatable", {}).get(resource, "-")
        print(f"{now:.1f} {name} {int(name in ready)} {alloc}")
    return 0


def samples(path):
    by_time = defaultdict(dict)
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 4:
                t, node, ready, alloc = fields
                by_time[float(t)][node] = (ready == "1", alloc)
    return sorted(by_time.items())


def allocatable_ok(alloc, count):
    return alloc in ("-", "0") if count == 0 else alloc == str(count)


def rollout(path, *args):
    bound = float(args[-1])
    want = {n: int(c) for n, c in (a.split("=", 1) for a in args[:-1])}
    rows = samples(path)
    if not rows:
        return "no samples", False
    for t, nodes in rows:
        down = [n for n in want if not nodes.get(n, (False, "-"))[0]]
        if len(down) > 1:
            return f"at {t - rows[0][0]:.0f}s {len(down)} nodes had no Ready plugin: {' '.join(down)}", False
    downtime = {}
    for node, count in want.items():
        went, back = None, None
        for t, nodes in rows:
            ready, alloc = nodes.get(node, (False, "-"))
            if not ready and went is None:
                went = t
            elif ready and went is not None and back is None:
                back = t
            if back is not None and not allocatable_ok(alloc, count) and t - back > bound:
                return f"{node}: allocatable {alloc} {t - back:.0f}s after its plugin was Ready again, want {count or 'none'} within {bound:.0f}s", False
        if went is None or back is None:
            return f"{node}: its plugin {'never left' if went is None else 'never came back'}", False
        final = rows[-1][1].get(node, (False, "-"))[1]
        if not allocatable_ok(final, count):
            return f"{node}: allocatable {final} at the end, want {count or 'none'}", False
        downtime[node] = back - went
    times = list(downtime.values())
    each = ", ".join(f"{n} {d:.0f}s" for n, d in downtime.items())
    return (f"without a plugin: {each} (median {statistics.median(times):.0f}s, max {max(times):.0f}s); "
            f"never 2 nodes at once; {len(rows)} samples", True)


def steady(path, node_count):
    node, count = node_count.split("=", 1)
    rows = samples(path)
    if not rows:
        return "no samples", False
    seen = sorted({nodes.get(node, (False, "absent"))[1] for _, nodes in rows})
    return (str(len(rows)), True) if seen == [count] else (" ".join(seen), False)


def main(command, *args):
    if command == "sample":
        return sample(*args)
    if command not in ("rollout", "steady"):
        raise SystemExit(f"unknown command {command}")
    message, ok = {"rollout": rollout, "steady": steady}[command](*args)
    print(message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
