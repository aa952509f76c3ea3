"""The workloads the cluster cases make, as JSON for `kubectl apply -f -`:
a Pod, a Job or a Deployment in the default namespace whose one container,
"probe" (busybox), asks for COUNT EFAs, lists /dev/infiniband, prints
FI_PROVIDER (what check_devices reads, FI_PROVIDER last so that the listing
is whole) and then execs sleep, so that its process is the container's.

--resource RESOURCE NAME KIND COUNT [OPTION...]   KIND is pod, job or deployment
--resource RESOURCE --each   reads such "NAME KIND COUNT [OPTION...]" lines
                             on stdin and prints them as one List, so that
                             many are made in one call
  --sleep SECONDS     how long it sleeps (default: 5 for a job, else 100000)
  --list PATH         also lists PATH, before FI_PROVIDER (repeatable)
  --label KEY=VALUE   on the object and its pods (repeatable)
  --restart POLICY    a pod's restartPolicy (default Never; a job's is Never,
                      a deployment's Always)
  --node NODE         may run on NODE only (nodeSelector)
  --bind NODE         bound to NODE, past the scheduler (nodeName)
  --prefer NODE       prefers NODE (node affinity), which a drain overrides
"""

import argparse
import json
import shlex
import sys

HOSTNAME = "kubernetes.io/hostname"


def container(resource, count, sleep, paths):
    listing = "; ".join(f"ls -l {p}" for p in ["/dev/infiniband", *paths])
    return {
        "name": "probe",
        "image": "localhost/busybox:1",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", f"{listing}; echo FI_PROVIDER=${{FI_PROVIDER:-unset}}; exec sleep {sleep}"],
        "resources": {"limits": {resource: count}},
    }


def pod_spec(args, restart):
    spec = {}
    if args.node:
        spec["nodeSelector"] = {HOSTNAME: args.node}
    if args.bind:
        spec["nodeName"] = args.bind
    if args.prefer:
        term = {"key": HOSTNAME, "operator": "In", "values": [args.prefer]}
        spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [term]}}]}}
    if restart:
        spec["restartPolicy"] = restart
    spec["terminationGracePeriodSeconds"] = 1
    sleep = args.sleep if args.sleep is not None else (5 if args.kind == "job" else 100000)
    spec["containers"] = [container(args.resource, args.count, sleep, args.list)]
    return spec


def workload(args):
    labels = dict(label.split("=", 1) for label in args.label)
    metadata = {"name": args.name, "namespace": "default"}
    if labels:
        metadata["labels"] = labels
    if args.kind == "pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec(args, args.restart)}
    if args.kind == "job":
        template = {"spec": pod_spec(args, "Never")}
        if labels:
            template["metadata"] = {"labels": labels}
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
                "spec": {"backoffLimit": 0, "template": template}}
    selector = {"app": args.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata,
            "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": {**labels, **selector}}, "spec": pod_spec(args, None)}}}


def parse(argv):
    parser = argparse.ArgumentParser(prog="workload.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--resource", required=True)
    parser.add_argument("name")
    parser.add_argument("kind", choices=["pod", "job", "deployment"])
    parser.add_argument("count", type=int)
    parser.add_argument("--sleep", type=int)
    parser.add_argument("--list", action="append", default=[])
    parser.add_argument("--label", action="append", default=[])
    parser.add_argument("--restart", choices=["Never", "Always"], default="Never")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--node")
    placement.add_argument("--bind")
    placement.add_argument("--prefer")
    return parser.parse_args(argv)


def main(argv):
    if "--each" in argv:
        argv.remove("--each")
        items = [workload(parse(argv + shlex.split(line))) for line in sys.stdin if line.strip()]
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    else:
        print(json.dumps(workload(parse(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
