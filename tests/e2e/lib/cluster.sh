# shellcheck shell=bash
# What every cluster case uses: kubectl and helm against the suite's
# cluster, reading the node, its pods and the kubelet's checkpoint, the
# workload pods, and the fixtures through which a case sets up what it needs
# instead of relying on the case before it. Sourced by cluster.sh, which sets
# BIN, KUBECONFIG, HELM, NODE, NS, DS, T and the fixture paths.
# shellcheck disable=SC2034 # REASON, POD_LOG, POD_IDS, POD_NODES, HOLDER_IDS and the names below are read by the cases

# This chart's release, as the README installs it; its DaemonSet is DS.
OURS_RELEASE=efa-device-plugin
# The AWS plugin's stand-in (cluster/migration.sh), released as the AWS chart is.
STANDIN_RELEASE=aws-efa-k8s-device-plugin
# The label nodeScope.mode=labelled keeps the plugin to.
SCOPE_LABEL=efa-device-plugin/enabled

# The extended resource the plugin advertises EFAs as.
RESOURCE=vpc.amazonaws.com/efa

k() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG" "$@"; }
kns() { k -n "$NS" "$@"; }
helm() { "$HELM" --kubeconfig "$KUBECONFIG" "$@"; }

# allocatable [NODE]: NODE's allocatable EFAs (the single-node cases' node by default).
allocatable() {
	k get node "${1:-$NODE}" -o jsonpath="{.status.allocatable.${RESOURCE//./\\.}}" 2>/dev/null
}

# allocatable_is COUNT [NODE]
allocatable_is() { [[ $(allocatable "${2:-}") == "$1" ]]; }

# ready_plugin_pod [NODE [SELECTOR]]: the one pod in the plugins' namespace
# on NODE (the single-node cases' node by default) matching the label
# SELECTOR (this plugin's by default, the stand-in's is name=$STANDIN_RELEASE)
# that is Ready and not terminating; empty otherwise.
ready_plugin_pod() {
	kns get pods -l "${2:-app.kubernetes.io/name=efa-device-plugin}" --field-selector "spec.nodeName=${1:-$NODE}" \
		-o json 2>/dev/null | python3 -c '
import json, sys
pods = [p for p in json.load(sys.stdin)["items"]
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
print(pods[0]["metadata"]["name"] if len(pods) == 1 else "")'
}

# has_ready_plugin_pod [NODE [SELECTOR]]
has_ready_plugin_pod() { [[ -n $(ready_plugin_pod "${1:-}" "${2:-}") ]]; }

no_plugin_pod() { [[ -z $(kns get pods -l app.kubernetes.io/name=efa-device-plugin -o name 2>/dev/null) ]]; }

pod_field() { k -n "${3:-default}" get pod "$1" -o jsonpath="$2" 2>/dev/null; }

# node_of POD [NAMESPACE]: the node POD is bound to.
node_of() { pod_field "$1" '{.spec.nodeName}' "${2:-default}"; }

pod_phase_is() { [[ $(pod_field "$1" '{.status.phase}') == "$2" ]]; }

# node_sysfs NODE: the tree NODE's plugin reads as its sysfs, read from the host.
node_sysfs() { node_host_path "$1" "$FIXTURES/sys"; }

# node_dp_dir NODE: NODE's device-plugin dir, read from the host.
node_dp_dir() { node_host_path "$1" "$DP_DIR"; }

# allocated_ids UID [NODE]: the device IDs the checkpoint of NODE's kubelet
# (the single-node cases' node by default) records for a pod.
allocated_ids() {
	python3 "$HERE/lib/kubeinfo.py" allocated "$(node_dp_dir "${2:-$NODE}")/kubelet_internal_checkpoint" "$1" "$RESOURCE" 2>/dev/null |
		paste -sd' '
}

# workload_json NAME KIND COUNT [OPTION...]: a Pod, Job or Deployment asking
# for COUNT EFAs, as lib/workload.py builds every workload of the cases
# (workload_json --each: many, from argument lines on stdin).
workload_json() { python3 "$HERE/lib/workload.py" --resource "$RESOURCE" "$@"; }

# workload NAME KIND COUNT [NODE]: a Job (KIND=job) or a long-running Pod
# (KIND=pod) whose container lists /dev/infiniband and prints FI_PROVIDER,
# then waits: the Job long enough for its allocation to be read, the Pod until
# deleted. With NODE, it may run on NODE only.
workload() { workload_json "$1" "$2" "$3" ${4:+--node "$4"} | k apply -f -; }

job_pod() { k get pods -l "job-name=$1" -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }

no_job_pod() { [[ -z $(k get pods -l "job-name=$1" -o name 2>/dev/null) ]]; }

# check_devices POD COUNT [NODE]: POD runs on NODE (the single-node cases'
# node by default) and its container saw exactly the uverbs nodes of the
# COUNT EFAs NODE's kubelet gave it, as NODE's sysfs tree pairs them; sets
# POD_LOG, POD_IDS and POD_NODES (its listing entries).
check_devices() {
	local pod=$1 count=$2 node=${3:-$NODE} uid got want id sys
	local -a ids
	if [[ $(node_of "$pod") != "$node" ]]; then
		REASON="pod $pod runs on '$(node_of "$pod")', want $node"
		return 1
	fi
	uid=$(pod_field "$pod" '{.metadata.uid}')
	read -ra ids <<<"$(allocated_ids "$uid" "$node")"
	if ((${#ids[@]} != count)); then
		REASON="$node's checkpoint gives pod $pod ${#ids[@]} devices [${ids[*]}], want $count"
		return 1
	fi
	wait_until 20 has_listing "$pod"
	POD_LOG=$T/logs/pod-$pod.log
	k logs "$pod" >"$POD_LOG"
	got=$(listing_entries <"$POD_LOG")
	sys=$(node_sysfs "$node")
	want=$(for id in "${ids[@]}"; do uverbs_entry "$sys" "$id"; done | sort)
	if [[ $got != "$want" ]]; then
		REASON="pod $pod on $node sees [$(paste -sd';' <<<"$got")] in /dev/infiniband, want [$(paste -sd';' <<<"$want")]"
		return 1
	fi
	POD_IDS=("${ids[@]}")
	POD_NODES=$got
}

# uverbs_entry SYSFS ID: the listing_entries line of the uverbs node of the
# EFA with device ID ID (its ibdev name, or its PCI address under
# device-id-strategy pci), from the tree as the kernel pairs them.
uverbs_entry() {
	local dev=$1/class/infiniband/$2/device verbs
	[[ -e $dev ]] || dev=$1/bus/pci/drivers/efa/$2
	verbs=$(basename "$(echo "$dev/infiniband_verbs/"*)")
	dev=$(cat "$1/class/infiniband_verbs/$verbs/dev")
	echo "c ${dev%%:*} ${dev##*:} $verbs"
}

# start_pod NAME COUNT [NODE]: a long-running pod asking for COUNT EFAs, made
# anew (pinned to NODE if given), Running within 60s, whose container saw
# exactly its EFAs (check_devices on the node it runs on); sets POD_LOG,
# POD_IDS and POD_NODES.
start_pod() {
	local name=$1 count=$2
	k delete pod "$name" --ignore-not-found --wait >/dev/null 2>&1
	workload "$name" pod "$count" "${3:-}" >/dev/null || { REASON="pod $name not accepted"; return 1; }
	if ! wait_until 60 pod_phase_is "$name" Running; then
		REASON="pod $name not Running within 60s: $(pod_field "$name" '{.status.phase}') $(pod_events "$name")"
		return 1
	fi
	check_devices "$name" "$count" "$(node_of "$name")"
}

# The container prints FI_PROVIDER after the listing, so the listing is whole.
has_listing() { k logs "$1" 2>/dev/null | grep -q '^FI_PROVIDER='; }

# run_job NAME COUNT: the scheduler places a Job asking for COUNT EFAs, its
# container sees exactly its devices, and the Job completes.
run_job() {
	local name=$1 count=$2 pod
	k delete job "$name" --ignore-not-found --wait >/dev/null 2>&1
	workload "$name" job "$count" >/dev/null || { REASON="Job $name not accepted"; return 1; }
	wait_until 60 job_pod_running "$name" || { REASON="Job $name has no Running pod within 60s: $(k get pods -l "job-name=$name" -o wide 2>&1 | tail -1)"; return 1; }
	pod=$(job_pod "$name")
	check_devices "$pod" "$count" || return 1
	if ! k wait --for=condition=Complete "job/$name" --timeout=60s >/dev/null; then
		REASON="Job $name not Complete within 60s"
		return 1
	fi
	k delete job "$name" --wait >/dev/null
	# The kubelet lists a finished pod's EFAs as held until the pod is gone, which the garbage
	# collector does after the Job: later cases must not see it.
	wait_until 60 no_job_pod "$name" || { REASON="Job $name's pod still there 60s after the Job"; return 1; }
}

job_pod_running() { local p; p=$(job_pod "$1") && [[ -n $p ]] && pod_phase_is "$p" Running; }

# The plugin pod's metrics endpoint, scraped over the pod network.
scrape() {
	local ip
	ip=$(pod_field "$1" '{.status.podIP}' "$NS")
	curl -sf --max-time 5 "http://$ip:9465/metrics"
}

# metric POD NAME: the value of NAME's series, labelled or not (efa_device_plugin_dra_conflict
# names its driver while it is 1).
metric() { scrape "$1" | awk -v n="$2" '{ name = $1; sub(/\{.*/, "", name) } name == n { print $NF }'; }

# plugin_container_id [POD]: the containerd ID of the plugin container in POD
# (the Ready plugin pod on the single-node cases' node by default).
plugin_container_id() {
	pod_field "${1:-$(ready_plugin_pod)}" '{.status.containerStatuses[0].containerID}' "$NS" | sed 's#^containerd://##'
}

plugin_events() {
	kns get events --field-selector involvedObject.kind=Pod -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null |
		tail -3 | paste -sd'|'
}

pod_events() {
	k get events --field-selector "involvedObject.name=$1" -o jsonpath='{range .items[*]}{.reason}: {.message}{"\n"}{end}' 2>/dev/null |
		paste -sd'|'
}

# ---------------------------------------------------------------- fixtures

# ours_install HELM_ARG...: this chart as the README installs it, plus only the
# test values (the local image and the fake sysfs tree).
ours_install() {
	ours_helm install "$@" >/dev/null || { REASON="helm install $OURS_RELEASE $* failed"; return 1; }
}

# ours_helm VERB HELM_ARG...: helm VERB (install, upgrade) of OURS_RELEASE
# from this chart with the test values and HELM_ARG...
ours_helm() { chart_helm "$1" "$OURS_RELEASE" -f "$TEST_VALUES" "${@:2}"; }

# chart_helm VERB RELEASE HELM_ARG...: helm VERB (install, upgrade, template)
# of this chart as RELEASE in the plugins' namespace.
chart_helm() { helm "$1" "$2" "$REPO/manifests/helm/efa-device-plugin" -n "$NS" "${@:3}"; }

# chart_template HELM_ARG...: the chart rendered as release efa with HELM_ARG...
# into a new file under the run dir; prints its path.
chart_template() {
	local out
	out=$(mktemp -p "$T" --suffix=.yaml helm-template.XXXXXX) && chart_helm template efa "$@" >"$out" && echo "$out"
}

# operator_crds: prometheus-operator's PodMonitor and PrometheusRule CRDs
# applied, and established within 60s.
operator_crds() {
	k apply --server-side "${OPERATOR_CRDS[@]/#/-f}" &&
		k wait --for condition=Established crd/podmonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com --timeout=60s
}

# uninstall_plugin: no plugin on the node, however a case installed it: the
# chart's releases uninstalled, then a kustomize install deleted. True once
# no plugin pod is left.
uninstall_plugin() {
	uninstall_releases
	[[ -z $(kns get daemonset "$DS" -o name 2>/dev/null) ]] ||
		k delete -k "$HERE/cluster/kustomize/p4d" --ignore-not-found --wait >/dev/null 2>&1
	wait_until 60 no_plugin_pod && return 0
	REASON="plugin pod still there 60s after its uninstall: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|')"
	return 1
}

# uninstall_releases: every release of this chart uninstalled, whatever its name.
uninstall_releases() {
	local release
	for release in $(helm list -n "$NS" -o json 2>/dev/null | python3 -c '
import json, sys
print(" ".join(r["name"] for r in json.load(sys.stdin) if r["chart"].startswith("efa-device-plugin-")))'); do
		helm uninstall "$release" -n "$NS" --wait >/dev/null 2>&1
	done
}

# "c MAJOR MINOR NAME" for each entry of a busybox `ls -l` listing on stdin;
# other output lines are skipped.
listing_entries() {
	awk '$1 != "total" && NF >= 6 { t = substr($1, 1, 1); maj = $5; sub(",", "", maj); print t, maj, $6, $NF }' | sort
}
