"""Reads what the e2e asserts on from the kubelet's own outputs.

pod URL NAME          phase, reason, uid and message of a pod in the kubelet's
                      /pods listing, tab-separated; "Absent" when not listed
restarts URL NAME     restarts of the pod's containers, summed; 0 when not listed
registered FILE RES   device IDs the device checkpoint lists as registered
allocated FILE UID RES  device IDs the checkpoint records for a pod
devices FILE UID RES  what the checkpoint records for a pod, one device a line:
                      container, the NUMA node the plugin reported (-1: none), ID
"""

import json
import sys
import urllib.request


def pod(url, name):
    with urllib.request.urlopen(url, timeout=5) as resp:
        pods = json.load(resp)
    for p in pods.get("items") or []:
        if p["metadata"]["name"] == name:
            status = p.get("status", {})
            fields = [
                status.get("phase") or "Unknown",
                status.get("reason") or "-",
                p["metadata"].get("uid") or "-",
                (status.get("message") or "-").replace("\n", " "),
            ]
            print("\t".join(fields))
            return
    print("Absent")


def restarts(url, name):
    with urllib.request.urlopen(url, timeout=5) as resp:
        pods = json.load(resp)
    count = 0
    for p in pods.get("items") or []:
        if p["metadata"]["name"] == name:
            statuses = p.get("status", {}).get("containerStatuses") or []
            count = sum(s.get("restartCount", 0) for s in statuses)
    print(count)


def checkpoint(path):
    with open(path) as f:
        return json.load(f)["Data"]


def registered(path, resource):
    for dev in sorted(checkpoint(path).get("RegisteredDevices", {}).get(resource) or []):
        print(dev)


def allocated(path, uid, resource):
    ids = set()
    for entry in checkpoint(path).get("PodDeviceEntries") or []:
        if entry["PodUID"] == uid and entry["ResourceName"] == resource:
            for numa_ids in entry["DeviceIDs"].values():
                ids.update(numa_ids)
    for dev in sorted(ids):
        print(dev)


def devices(path, uid, resource):
    rows = set()
    for entry in checkpoint(path).get("PodDeviceEntries") or []:
        if entry["PodUID"] == uid and entry["ResourceName"] == resource:
            for numa, numa_ids in entry["DeviceIDs"].items():
                rows.update((entry["ContainerName"], numa, dev) for dev in numa_ids)
    for row in sorted(rows):
        print(" ".join(row))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"pod": pod, "restarts": restarts, "registered": registered, "allocated": allocated, "devices": devices}[cmd](*args)
