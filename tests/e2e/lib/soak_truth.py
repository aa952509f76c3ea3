"""The soak's ground truth and its report (tests/e2e/cluster/soak.sh).

truth NODE=CGROUP_ROOT:SYSFS:PODRESOURCES ... < PODS_JSON
    Reads, for each NODE, every container of the workload namespace (default)
    running under CGROUP_ROOT's kubepods (in the pids hierarchy): the uverbs
    nodes in its /dev/infiniband, through its first process, by major and
    minor. PODS_JSON is `kubectl get pods -A -o json`, to name each pod and
    container (the plugin pods, which see every node, are not workloads);
    PODRESOURCES is the output of tests/e2e/podresources for NODE, and SYSFS
    NODE's sysfs tree, to turn its IDs into device numbers. Prints one line per
    violation:
      double <node> <dev> <pod> <pod>   one device inside running containers of two pods
      differs <node> <container> ...   PodResources and the inside disagree
    then "truth <containers> <double-booked devices>" last. Containers younger
    than --settle seconds, or of terminating pods, are left out of the
    comparison with PodResources (either side may still be catching up).

slope FILE
    FILE holds "cycle pid value" lines; prints the least-squares slope of
    value per cycle over the longest run of one pid, and that run's length.

quantiles FILE
    FILE holds "kind milliseconds" lines; prints "kind n median p99" per kind.

burst TRUTH PLUGIN_LOG ALLOCS CONFIRM
    The admission burst's verdict. TRUTH holds "seconds <truth's double line
    without its first word>" samples; PLUGIN_LOG each plugin's JSON log, each
    line led by its node; ALLOCS "before|after NODE COUNT SUM" lines of the
    kubelet's Allocate-duration histogram. Prints the Allocate calls and their
    mean, and how often the kubelet offered GetPreferredAllocation an ID again
    within 1 s of an answer choosing it (the plugins' debug lines), then one line per pair of pods on one node that the ground truth
    saw: "missed ..." when it lasted CONFIRM seconds or more and the plugin
    did not warn of it, "pair ..." otherwise; then one "detector-only ..."
    line per pair the plugin warned of that the ground truth never saw; and
    "ground truth G pairs, detector D pairs" last.
"""

import datetime
import json
import os
import statistics
import sys
from collections import defaultdict

PIDS = "/sys/fs/cgroup/pids"


def containers(root):
    """(pod uid, container id, pid) for every container cgroup with a process."""
    base = os.path.join(PIDS, root.lstrip("/"), "kubepods")
    for dirpath, _, _ in os.walk(base):
        parent, cid = os.path.split(dirpath)
        pod = os.path.basename(parent)
        if not pod.startswith("pod"):
            continue
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                pids = f.read().split()
        except OSError:
            continue
        if pids:
            yield pod[3:].replace("_", "-"), cid, pids[0]


def inside(pid):
    """The uverbs nodes in the process's /dev/infiniband, as "major:minor"."""
    devs = set()
    top = f"/proc/{pid}/root/dev/infiniband"
    try:
        names = os.listdir(top)
    except OSError:
        return devs
    for name in names:
        if name.startswith("uverbs"):
            try:
                rdev = os.stat(os.path.join(top, name)).st_rdev
            except OSError:
                continue
            devs.add(f"{os.major(rdev)}:{os.minor(rdev)}")
    return devs


def id_devices(sysfs):
    """Each ID (ibdev name and PCI address) of the tree to its uverbs node's "major:minor"."""
    out = {}
    verbs = os.path.join(sysfs, "class/infiniband_verbs")
    for name in os.listdir(verbs) if os.path.isdir(verbs) else []:
        with open(os.path.join(verbs, name, "dev")) as f:
            dev = f.read().strip()
        with open(os.path.join(verbs, name, "ibdev")) as f:
            out[f.read().strip()] = dev
        out[os.path.basename(os.path.realpath(os.path.join(verbs, name, "device")))] = dev
    return out


WORKLOADS = "default"


def truth(args, pods_json, settle):
    pods = {}
    now = datetime.datetime.now(datetime.timezone.utc)
    for p in json.loads(pods_json)["items"]:
        if p["metadata"]["namespace"] != WORKLOADS:
            continue
        names = {}
        for s in p.get("status", {}).get("containerStatuses") or []:
            started = (s.get("state", {}).get("running") or {}).get("startedAt")
            age = (now - datetime.datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds() if started else 0
            names[(s.get("containerID") or "").split("//")[-1]] = (s["name"], age)
        key = f'{p["metadata"]["namespace"]}/{p["metadata"]["name"]}'
        pods[p["metadata"]["uid"]] = (key, names, bool(p["metadata"].get("deletionTimestamp")))
    violations, seen, doubles = [], 0, 0
    for arg in args:
        node, spec = arg.split("=", 1)
        root, sysfs, podres = spec.split(":", 2)
        devs = id_devices(sysfs)
        said = {}
        with open(podres) as f:
            for line in f:
                fields = line.split()
                if fields:
                    said[fields[0]] = {devs.get(i, f"unknown:{i}") for i in fields[1:]}
        holders = defaultdict(set)
        for uid, cid, pid in containers(root):
            key, names, terminating = pods.get(uid, (None, {}, False))
            name, age = names.get(cid, (None, 0))
            if name is None:
                continue  # not a workload, a sandbox, or a container the API does not show yet
            have = inside(pid)
            seen += 1
            for dev in have:
                holders[dev].add(key)
            want = said.get(f"{key}/{name}", set())
            if not terminating and age >= settle and have != want:
                violations.append(f"differs {node} {key}/{name} inside {sorted(have)} podresources {sorted(want)}")
        for dev, keys in sorted(holders.items()):
            if len(keys) > 1:
                doubles += 1
                violations.append(f"double {node} {dev} {' '.join(sorted(keys))}")
    for v in violations:
        print(v)
    print(f"truth {seen} {doubles}")


def slope(path):
    runs = defaultdict(list)
    with open(path) as f:
        for line in f:
            cycle, pid, value = line.split()
            runs[pid].append((float(cycle), float(value)))
    longest = max(runs.values(), key=len, default=[])
    if len(longest) < 2:
        print(f"0 {len(longest)}")
        return
    xs, ys = zip(*longest)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    print(f"{sum((x - mx) * (y - my) for x, y in longest) / den if den else 0:.2f} {len(longest)}")


def quantiles(path):
    by_kind = defaultdict(list)
    with open(path) as f:
        for line in f:
            kind, ms = line.split()
            by_kind[kind].append(int(ms))
    for kind, values in sorted(by_kind.items()):
        values.sort()
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        print(kind, len(values), int(statistics.median(values)), p99)


def plugin_log(path):
    """(node, record) of every JSON line of the plugins' logs, each line led by its node."""
    with open(path) as f:
        for line in f:
            node, _, text = line.partition(" ")
            try:
                yield node, json.loads(text)
            except ValueError:
                continue


def warned_pairs(path):
    """(node, pod, pod) of every pair of pods a double-booking warning in the plugins' logs
    names (`pods`, comma-separated)."""
    pairs = set()
    for node, record in plugin_log(path):
        if "double-booked" in str(record.get("message", "")):
            pods = sorted(filter(None, str(record.get("pods", "")).split(",")))
            pairs.update((node, a, b) for i, a in enumerate(pods) for b in pods[i + 1:])
    return pairs


def reoffers(path, within=1.0):
    """From the plugins' GetPreferredAllocation debug lines: how often the kubelet offered an ID
    again within `within` seconds of an answer choosing it (it takes the answer, so it had just
    allocated that ID: it lost track of it), and how often the new answer left such IDs out."""
    answers = defaultdict(list)
    for node, record in plugin_log(path):
        if record.get("message") != "answered GetPreferredAllocation":
            continue
        at = datetime.datetime.fromisoformat(record["timestamp"]).timestamp()
        split = lambda key: set(filter(None, str(record.get(key, "")).split(",")))
        answers[node].append((at, split("offered"), split("answer")))
    count = again = steered = 0
    for seq in answers.values():
        seq.sort(key=lambda a: a[0])
        for i, (at, offered, answer) in enumerate(seq):
            count += 1
            lost = set()
            for before, _, chosen in reversed(seq[:i]):
                if at - before > within:
                    break
                lost |= chosen & offered
            if lost:
                again += 1
                steered += not (lost & answer)
    return f"{count} GetPreferredAllocation answers; an ID offered again within {within:g} s of being chosen: {again}, left out by the answer: {steered}"


def allocate_calls(path):
    totals = defaultdict(lambda: [0.0, 0.0])
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 4:
                sign = 1 if fields[0] == "after" else -1
                totals[fields[1]][0] += sign * float(fields[2])
                totals[fields[1]][1] += sign * float(fields[3])
    count = sum(c for c, _ in totals.values())
    seconds = sum(s for _, s in totals.values())
    return f"{int(count)} Allocate calls, mean {1000 * seconds / count:.2f} ms" if count else "Allocate calls unknown"


def burst(truth_path, log_path, allocs_path, confirm):
    seen = {}
    with open(truth_path) as f:
        for line in f:
            at, node, _dev, *pods = line.split()
            for i, a in enumerate(pods):
                for b in pods[i + 1:]:
                    first, last = seen.get((node, a, b), (float(at), float(at)))
                    seen[(node, a, b)] = (min(first, float(at)), max(last, float(at)))
    warned = warned_pairs(log_path)
    print(allocate_calls(allocs_path))
    print(reoffers(log_path))
    for pair, (first, last) in sorted(seen.items()):
        lasted = last - first
        verdict = "pair" if pair in warned or lasted < float(confirm) else "missed"
        print(f"{verdict} {' '.join(pair)}: seen for {lasted:.0f}s, warned {'yes' if pair in warned else 'no'}")
    for pair in sorted(warned - seen.keys()):
        print(f"detector-only {' '.join(pair)}")
    print(f"ground truth {len(seen)} pairs, detector {len(warned)} pairs")


def main(command, *args):
    if command == "truth":
        settle = 5.0
        if args and args[0].startswith("--settle="):
            settle, args = float(args[0].split("=", 1)[1]), args[1:]
        truth(args, sys.stdin.read(), settle)
    elif command == "slope":
        slope(*args)
    elif command == "quantiles":
        quantiles(*args)
    elif command == "burst":
        burst(*args)
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(*sys.argv[1:])
