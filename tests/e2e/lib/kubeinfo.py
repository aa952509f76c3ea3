"""Reads what the e2e asserts on from the kubelet's own outputs.

allocated FILE UID RES  device IDs the checkpoint records for a pod
"""

import json
import sys


def checkpoint(path):
    with open(path) as f:
        return json.load(f)["Data"]


def allocated(path, uid, resource):
    ids = set()
    for entry in checkpoint(path).get("PodDeviceEntries") or []:
        if entry["PodUID"] == uid and entry["ResourceName"] == resource:
            for numa_ids in entry["DeviceIDs"].values():
                ids.update(numa_ids)
    for dev in sorted(ids):
        print(dev)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"allocated": allocated}[cmd](*args)
