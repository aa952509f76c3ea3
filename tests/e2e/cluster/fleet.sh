# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# A fleet on this host: beside efa-a (p4d, 4 EFAs, the single-node cases'
# node) the nodes efa-b (p5en, 16 EFAs with other names) and plain (no EFA),
# each in namespaces of its own (lib/nodes.sh), all registered with the one
# control plane. The cases show what users live through on fleets: here a
# node that joins late (F5) and a reboot (F6); the typed runner holds the
# others (tests/e2e/runner/src/cluster/fleet/) and asks for the fleet and the
# chart through cluster.sh's host_request.
#
# Sourced by cluster.sh; besides lib/cluster.sh's helpers it uses
# migration.sh's stand-in. The fleet
# comes up with the first fleet case that runs and stays up to the end of the
# run, so the single-node cases, which run before, see efa-a alone. Each case
# pins its pods to the nodes it is about.

FLEET_B=efa-b
FLEET_PLAIN=plain
# shellcheck disable=SC2153 # NODE is cluster.sh's
FLEET=("$NODE" "$FLEET_B" "$FLEET_PLAIN")
declare -A NODE_SHAPE=([$NODE]=p4d [$FLEET_B]=p5en [$FLEET_PLAIN]=none)
declare -A NODE_EFAS=([$NODE]=4 [$FLEET_B]=16 [$FLEET_PLAIN]=0)
declare -A FLEET_SLOT=([$FLEET_B]=1 [$FLEET_PLAIN]=2)

# make_node_fixtures NODE (for add_node): the sysfs tree of NODE's shape, and
# the uverbs nodes its EFAs have.
make_node_fixtures() {
	local home
	home=$(node_home "$1")
	mkdir -p "$home/fixtures/sys/class" "$home/dev/infiniband" || return 1
	case ${NODE_SHAPE[$1]} in
	p4d | p5en) fake_host "${NODE_SHAPE[$1]}" "$home/fixtures/sys" "$home/dev" ;;
	none) ;;
	esac
}

# ensure_fleet: efa-b and plain up and Ready, started once per run.
ensure_fleet() {
	local node
	for node in "$FLEET_B" "$FLEET_PLAIN"; do
		if [[ -z ${NODE_HOLDER[$node]:-} ]]; then
			add_node "$node" "${FLEET_SLOT[$node]}" || return 1
		elif ! node_ready "$node"; then
			REASON="fleet node $node is not Ready"
			return 1
		fi
	done
}

# fleet_chart [HELM_ARGS...]: the fleet up, no pod left in default, and the
# chart installed anew with the suite's values and HELM_ARGS.
# shellcheck disable=SC2120 # the runner's chart request passes HELM_ARGS (cluster.sh's host_request)
fleet_chart() {
	ensure_fleet || return 1
	uninstall_plugin || return 1
	k delete pods,deployments,jobs --all -n default --wait >/dev/null 2>&1
	ours_install "$@"
}

# fleet_serving NODE...: each NODE with a Ready plugin pod and its count allocatable.
fleet_serving() {
	local node
	for node in "$@"; do
		fleet_node_serves "$node" || return 1
	done
}

# fleet_node_serves NODE: a Ready plugin pod on NODE within 120s, and NODE's
# count allocatable within a status period and 30s.
fleet_node_serves() {
	local node=$1
	if ! wait_until 120 has_ready_plugin_pod "$node"; then
		REASON="no Ready plugin pod on $node within 120s: $(kns get pods -o wide 2>&1 | grep -w "$node" | paste -sd'|')"
		return 1
	fi
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_settled "$node"; then
		REASON="allocatable on $node is '$(allocatable "$node")', want ${NODE_EFAS[$node]}"
		return 1
	fi
}

# allocatable_settled NODE: NODE's count allocatable; 0 or none on a node
# without EFA.
allocatable_settled() {
	local got
	got=$(allocatable "$1")
	((${NODE_EFAS[$1]} == 0)) && [[ $got == "" || $got == 0 ]] && return 0
	[[ $got == "${NODE_EFAS[$1]}" ]]
}

# install_labelled_kustomize: the plugin anew from the labelled overlay, on
# the fleet (the runner's F2 asks for it).
install_labelled_kustomize() {
	ensure_fleet && uninstall_plugin || return 1
	k apply -k "$HERE/cluster/kustomize/labelled" >/dev/null && return 0
	REASON="kubectl apply -k rejected the labelled overlay"
	return 1
}

allocatable_above_0() { [[ $(allocatable "$1") =~ ^[1-9] ]]; }

# since_ms START: milliseconds since START, an $EPOCHREALTIME.
since_ms() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", (b - a) * 1000 }'; }

# join_once NODE SELECTOR: with a pod Pending that asks for 2 EFAs and
# selects NODE, NODE (p4d) joins; appends "PLUGIN ALLOCATABLE POD" to JOINS,
# the milliseconds from NODE Ready to its plugin pod (SELECTOR) Ready, to
# allocatable above 0, and to the pod Running. NODE goes again afterwards.
JOINS=()
join_once() {
	local node=$1 ok=0
	NODE_SHAPE[$node]=p4d
	workload late pod 2 "$node" >/dev/null || { REASON="pod late not accepted"; return 1; }
	add_node "$node" 3 && join_measure "$@" && ok=1
	# Forced: the node goes next, and a pod on a node that is gone waits for the pod GC.
	k delete pod late --grace-period=0 --force >/dev/null 2>&1
	remove_node "$node"
	((ok))
}

# join_measure NODE SELECTOR: join_once's figures, from NODE Ready.
join_measure() {
	local node=$1 selector=$2 ready plugin alloc pod
	ready=$EPOCHREALTIME
	wait_until 120 has_ready_plugin_pod "$node" "$selector" || { REASON="no Ready plugin pod ($selector) on $node within 120s"; return 1; }
	plugin=$(since_ms "$ready")
	wait_until 120 allocatable_above_0 "$node" || { REASON="no $RESOURCE allocatable on $node within 120s"; return 1; }
	alloc=$(since_ms "$ready")
	wait_until 120 pod_phase_is late Running || { REASON="pod late not Running on $node within 120s: $(pod_events late)"; return 1; }
	pod=$(since_ms "$ready")
	JOINS+=("$plugin $alloc $pod")
}

# join_medians: the medians of JOINS, as "plugin Xs, allocatable Ys, pod Zs".
join_medians() {
	printf '%s\n' "${JOINS[@]}" | python3 -c '
import statistics, sys
rows = [list(map(int, l.split())) for l in sys.stdin if l.strip()]
med = [statistics.median(col) / 1000 for col in zip(*rows)]
print(f"plugin Ready {med[0]:.1f}s, allocatable {med[1]:.1f}s, pod Running {med[2]:.1f}s")'
}

JOIN_ROUNDS=3

case_fleet_late_join() {
	local i ours aws ok=1
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	JOINS=()
	for i in $(seq "$JOIN_ROUNDS"); do
		join_once "efa-late-$i" app.kubernetes.io/name=efa-device-plugin || return 1
	done
	ours=$(join_medians)
	# The AWS plugin's stand-in, installed as the AWS chart installs it, on every node.
	uninstall_plugin && standin_image || return 1
	IMAGES_FOR_NODES+=("$T/images/aws-standin.tar")
	for i in "$FLEET_B" "$FLEET_PLAIN"; do
		ctr_on "$i" images import "$T/images/aws-standin.tar" >/dev/null 2>&1 || { REASON="cannot import the stand-in image on $i"; return 1; }
	done
	standin_chart || return 1
	JOINS=()
	for i in $(seq "$JOIN_ROUNDS"); do
		join_once "efa-late-aws-$i" "name=$STANDIN_RELEASE" || { ok=0; break; }
	done
	aws=$(join_medians)
	unset "IMAGES_FOR_NODES[-1]"
	standin_uninstall || return 1
	((ok)) || return 1
	CASE_DETAIL="medians over $JOIN_ROUNDS joins from node Ready: this plugin: $ours; AWS stand-in: $aws"
	note "F5 join medians: ours [$ours], aws [$aws]"
}

# reboot_pod NAME KIND PLACEMENT...: a bare pod that always restarts
# (KIND=pod) or a Deployment's pod, holding 2 EFAs, placed on efa-a by
# PLACEMENT (workload_json's --node or --bind).
reboot_pod() { workload_json "$1" "$2" 2 --restart Always "${@:3}" | k apply -f - >/dev/null; }

# reboot_pods: on efa-a, a bare pod and a Deployment's pod, each holding 2 EFAs.
reboot_pods() { reboot_pod rb-bare pod --node "$NODE" && reboot_pod rb-deploy deployment --node "$NODE"; }

# pods_outcome: each pod of the default namespace: name, phase, reason and restarts.
pods_outcome() {
	k get pods -n default -o json 2>/dev/null | python3 -c '
import json, sys
for p in sorted(json.load(sys.stdin)["items"], key=lambda p: p["metadata"]["creationTimestamp"]):
    st = p["status"]
    restarts = sum(c.get("restartCount", 0) for c in st.get("containerStatuses") or [])
    print(p["metadata"]["name"], st.get("phase", "?"), st.get("reason", "-"), restarts)'
}

# deploy_running_on_a: the Deployment has a Running pod on efa-a.
deploy_running_on_a() {
	local p
	for p in $(k get pods -l app=rb-deploy -o jsonpath='{.items[*].metadata.name}' 2>/dev/null); do
		pod_phase_is "$p" Running && [[ $(node_of "$p") == "$NODE" ]] && return 0
	done
	return 1
}

# klog_seconds LINE: the time of day of a klog LINE, in seconds.
klog_seconds() { awk '{ split($2, t, ":"); printf "%.3f\n", t[1] * 3600 + t[2] * 60 + t[3] }' <<<"$1"; }

# plugin_start_ms NODE: from the "starting" line of NODE's plugin to its first
# "registered with the kubelet", in its log.
plugin_start_ms() {
	kns logs "$(ready_plugin_pod "$1")" 2>/dev/null | python3 -c '
import datetime, json, sys
seen = {}
for line in sys.stdin:
    try:
        record = json.loads(line)
    except ValueError:
        continue
    message = record.get("message")
    if message in ("starting", "registered with the kubelet") and message not in seen:
        seen[message] = datetime.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
if len(seen) == 2:
    print(round((seen["registered with the kubelet"] - seen["starting"]).total_seconds() * 1000))
else:
    print("?")'
}

# registration_logged LOG MARK: the first line after line MARK of the kubelet
# LOG that records a registration of the plugin's resource.
registration_logged() {
	tail -n +"$(($2 + 1))" "$1" | grep -m1 "Got registration request from device plugin with resource.*$RESOURCE"
}

# settled POD: POD Running, or Failed.
settled() { pod_phase_is "$1" Running || pod_phase_is "$1" Failed; }

case_fleet_reboot() {
	local mark log first reg window outcome pod state
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	reboot_pods || { REASON="the reboot case's pods were not accepted"; return 1; }
	if ! { wait_until 60 pod_phase_is rb-bare Running && wait_until 60 deploy_running_on_a; }; then
		REASON="the reboot case's pods are not Running: $(pods_outcome | paste -sd'|')"
		return 1
	fi
	log=$T/logs/kubelet-$NODE.log
	stop_node "$NODE"
	# A pod bound to efa-a while it is down, as one bound before a reboot and not yet started:
	# the kubelet admits it at start, with or without the plugin.
	reboot_pod rb-new pod --bind "$NODE" || { REASON="pod rb-new not accepted"; return 1; }
	mark=$(wc -l <"$log")
	start_node "$NODE" || return 1
	# The API shows the old plugin pod Ready until the kubelet says otherwise: the kubelet's log tells.
	wait_until 120 registration_logged "$log" "$mark" ||
		{ REASON="no registration of $RESOURCE in $NODE's kubelet log 120s after its reboot"; return 1; }
	first=$(tail -n +"$((mark + 1))" "$log" | grep -m1 '^[IWE][0-9]')
	reg=$(registration_logged "$log" "$mark")
	window=$(awk -v a="$(klog_seconds "$first")" -v b="$(klog_seconds "$reg")" 'BEGIN { printf "%.1f", b - a }')
	# What became of the pods: the bare one Running again or Failed, the Deployment Running on efa-a.
	if ! { wait_until 90 settled rb-bare && wait_until 90 settled rb-new && wait_until 90 deploy_running_on_a; }; then
		REASON="pods not settled 90s after the reboot: $(pods_outcome | paste -sd'|')"
		return 1
	fi
	outcome=$(pods_outcome | paste -sd',')
	for pod in rb-bare rb-new; do
		state=$(pods_outcome | awk -v p="$pod" '$1 == p { print $2, $3 }')
		if [[ $state != "Running -" && $state != "Failed UnexpectedAdmissionError" ]]; then
			REASON="$pod ended '$state' after the reboot, want Running or Failed UnexpectedAdmissionError: $outcome"
			return 1
		fi
	done
	fleet_serving "$NODE" || return 1
	CASE_DETAIL="kubelet start to Register ${window}s, of which the plugin's own start to Register $(plugin_start_ms "$NODE") ms; pods (name phase reason restarts): $outcome"
	note "F6 reboot: $CASE_DETAIL"
	k delete deployment rb-deploy --wait >/dev/null
	k delete pods --all -n default --wait >/dev/null
}

fleet_cases() {
	run_case "(F5) a node that joins late: node Ready to plugin, allocatable and a waiting pod Running, this plugin and the AWS stand-in" case_fleet_late_join
	run_case "(F6) $NODE rebooted: kubelet start to Register, and what became of the pods holding EFAs there" case_fleet_reboot
}
