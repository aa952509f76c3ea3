"""Reads what the topology suite asserts on from the plugin's and kubelet's output.

fixture                  `efa-device-plugin list --output json` on stdin: one
                         "ID NUMA IBDEV" line per EFA (NUMA -1: none)
gpa LOG SKIP             the plugin's GetPreferredAllocation answers in LOG after
                         the first SKIP: "OFFERED|MUST|SIZE|ANSWER", ID lists
                         comma-separated (a field may be empty)
hints LOG POD RES        the hints of the kubelet's TopologyHints lines in LOG for
                         the static pod POD and resource RES, one line per line
                         logged: "CONTAINER NODES:PREFERRED ...", NODES the NUMA
                         nodes of the mask, comma-separated (CONTAINER "-" in
                         pod scope; "null" when the kubelet had no preference)
"""

import json
import re
import sys

GPA = re.compile(r"answered GetPreferredAllocation.* offered=(\S*) must_include=(\S*) size=(-?\d+) answer=(\S*)")
CONTAINER = re.compile(r'containerName="([^"]*)"')
# klog writes the hints as JSON, each mask as its integer value (bit n: node n).
HINT = re.compile(r'"NUMANodeAffinity":(\d+|null),"Preferred":(true|false)')


def fixture():
    for row in json.load(sys.stdin):
        numa = row.get("numa_node")
        print(row["id"], -1 if numa is None else numa, row["ibdev"])


def gpa(log, skip):
    answers = []
    with open(log, errors="replace") as f:
        for line in f:
            m = GPA.search(line)
            if m:
                answers.append("|".join(m.groups()))
    for answer in answers[int(skip):]:
        print(answer)


def resource_section(line, resource):
    """The text of the hint list logged for `resource`, "null", or None when it is not in the line."""
    if f'"{resource}":null' in line:
        return "null"
    key = f'"{resource}":['
    start = line.find(key)
    if start < 0:
        return None
    start += len(key)
    depth = 1
    for i in range(start, len(line)):
        depth += {"[": 1, "]": -1}.get(line[i], 0)
        if depth == 0:
            return line[start:i]
    return None


def nodes(mask):
    if mask == "null":
        return "any"
    value = int(mask)
    return ",".join(str(n) for n in range(64) if value >> n & 1)


def hints(log, pod, resource):
    with open(log, errors="replace") as f:
        for line in f:
            if '"TopologyHints"' not in line or f'pod="default/{pod}"' not in line:
                continue
            section = resource_section(line, resource)
            if section is None:
                continue
            container = CONTAINER.search(line)
            masks = ["null"] if section == "null" else [f"{nodes(m)}:{p}" for m, p in HINT.findall(section)]
            print(" ".join([container.group(1) if container else "-"] + masks))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"fixture": fixture, "gpa": gpa, "hints": hints}[cmd](*args)
