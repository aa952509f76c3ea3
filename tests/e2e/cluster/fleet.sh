# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# A fleet on this host: beside efa-a (p4d, 4 EFAs, the single-node cases'
# node) the nodes efa-b (p5en, 16 EFAs with other names) and plain (no EFA),
# each in namespaces of its own (lib/nodes.sh), all registered with the one
# control plane. The cases show what users live through on fleets: one plugin
# per node, placement by each node's count, rollouts and restarts that touch
# one node at a time, a drain.
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
	p4d) make_fake_efa_host "$home/fixtures/sys" "$home/dev" ;;
	p5en) make_fake_p5en_host "$home/fixtures/sys" "$home/dev" ;;
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

# plugin_ids NODE: the IDs `list` prints in NODE's plugin pod, sorted, on one line.
plugin_ids() {
	local pod
	pod=$(ready_plugin_pod "$1") && [[ -n $pod ]] || return 1
	kns exec "$pod" -- /efa-device-plugin --sysfs-root "$SYSFS_IN_POD" list --output json 2>/dev/null |
		python3 -c 'import json, sys; print(" ".join(sorted(r["id"] for r in json.load(sys.stdin))))'
}

# ibdevs_of NODE: the names under NODE's class/infiniband, sorted, on one line.
ibdevs_of() { find "$(node_sysfs "$1")/class/infiniband" -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort | paste -sd' '; }

case_fleet_one_plugin_per_node() {
	local node got want alloc detail=
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	for node in "${FLEET[@]}"; do
		got=$(plugin_ids "$node")
		want=$(ibdevs_of "$node")
		if [[ $got != "$want" ]]; then
			REASON="the plugin on $node lists [$got], want its own EFAs [$want]"
			return 1
		fi
		alloc=$(allocatable "$node")
		detail+="$node: ${alloc:-no} allocatable, $(wc -w <<<"$got") IDs; "
	done
	CASE_DETAIL=${detail%; }
}

case_fleet_placement() {
	local n i node
	local -A on=()
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	# More than efa-a has: the scheduler can only pick efa-b.
	start_pod big 5 || return 1
	check_devices big 5 "$FLEET_B" || return 1
	k delete pod big --wait >/dev/null
	# More than any node has, less than the fleet has.
	n=$((NODE_EFAS[$FLEET_B] + 1))
	workload huge pod "$n" >/dev/null || { REASON="pod huge not accepted"; return 1; }
	if ! wait_until 30 pod_unschedulable_for_efa huge; then
		REASON="pod asking for $n is not Pending for $RESOURCE: $(pod_events huge)"
		return 1
	fi
	k delete pod huge --wait >/dev/null
	# Pods of 4: one fits on efa-a, four on efa-b, none on plain, the rest wait.
	for i in 1 2 3 4 5 6; do
		workload "four-$i" pod 4 >/dev/null || { REASON="pod four-$i not accepted"; return 1; }
	done
	wait_until 90 pods_placed 5 || { REASON="$(pods_placed_summary)"; return 1; }
	for i in 1 2 3 4 5 6; do
		node=$(node_of "four-$i")
		[[ -n $node ]] && on[$node]=$((${on[$node]:-0} + 1))
		if [[ -n $node ]] && pod_phase_is "four-$i" Running; then
			check_devices "four-$i" 4 "$node" || return 1
		fi
	done
	if [[ ${on[$NODE]:-0} != 1 || ${on[$FLEET_B]:-0} != 4 || -n ${on[$FLEET_PLAIN]:-} ]]; then
		REASON="pods of 4 landed: $(pods_placed_summary), want 1 on $NODE, 4 on $FLEET_B, none on $FLEET_PLAIN"
		return 1
	fi
	CASE_DETAIL="5 on $FLEET_B; $n Pending (Insufficient); pods of 4: 1 on $NODE, 4 on $FLEET_B, 1 Pending"
	k delete pod four-1 four-2 four-3 four-4 four-5 four-6 --wait >/dev/null
}

# pod_unschedulable_for_efa POD: the scheduler's reason names too few EFAs.
pod_unschedulable_for_efa() {
	pod_phase_is "$1" Pending &&
		[[ $(pod_field "$1" '{.status.conditions[?(@.type=="PodScheduled")].message}') == *"Insufficient $RESOURCE"* ]]
}

# pods_placed N: N of the pods four-* Running and the others Pending for EFAs.
pods_placed() {
	local i running=0 waiting=0
	for i in 1 2 3 4 5 6; do
		if pod_phase_is "four-$i" Running; then
			running=$((running + 1))
		elif pod_unschedulable_for_efa "four-$i"; then
			waiting=$((waiting + 1))
		fi
	done
	((running == $1 && waiting == 6 - $1))
}

pods_placed_summary() { k get pods -o wide --no-headers 2>&1 | awk '$1 ~ /^four-/ { print $1, $3, $7 }' | paste -sd'|'; }

case_fleet_isolation() {
	local before after restarts pod a_pod samples
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	start_pod held-b 2 "$FLEET_B" || return 1
	pod=$(ready_plugin_pod "$FLEET_B")
	before="$(metric "$pod" efa_device_plugin_registrations_total) $(allocatable "$FLEET_B") $(pod_field held-b '{.status.containerStatuses[0].restartCount}')"
	start_daemon isolation-watch watch_fleet "$T/isolation"
	# efa-a's kubelet restarts; the plugin registers again there.
	stop_daemon "kubelet-$NODE"
	start_node_kubelet "$NODE" || { REASON="$NODE not Ready after its kubelet restarted"; return 1; }
	fleet_node_serves "$NODE" || return 1
	# Then efa-a's plugin container is killed.
	a_pod=$(ready_plugin_pod "$NODE")
	ctr_k8s tasks kill -s SIGKILL "$(plugin_container_id "$a_pod")" >/dev/null 2>&1 ||
		{ REASON="cannot kill the plugin container on $NODE"; return 1; }
	wait_until 60 plugin_restarted "$a_pod" || { REASON="the plugin on $NODE did not restart"; return 1; }
	fleet_node_serves "$NODE" || return 1
	stop_daemon isolation-watch
	after="$(metric "$pod" efa_device_plugin_registrations_total) $(allocatable "$FLEET_B") $(pod_field held-b '{.status.containerStatuses[0].restartCount}')"
	if [[ $after != "$before" ]]; then
		REASON="on $FLEET_B, registrations, allocatable and the holder's restarts went from [$before] to [$after]"
		return 1
	fi
	if ! samples=$(python3 "$HERE/lib/fleet_watch.py" steady "$T/isolation" "$FLEET_B=${NODE_EFAS[$FLEET_B]}"); then
		REASON="$FLEET_B's allocatable changed meanwhile: $samples"
		return 1
	fi
	check_devices held-b 2 "$FLEET_B" || return 1
	CASE_DETAIL="$FLEET_B unchanged (registrations, allocatable, holder restarts: $after) over $samples samples"
	k delete pod held-b --wait >/dev/null
}

plugin_restarted() { [[ $(pod_field "$1" '{.status.containerStatuses[0].restartCount}' "$NS") -ge 1 ]]; }

case_fleet_drain() {
	local pod
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	# The Deployment's pod is pinned to efa-a by a preference only, which a drain overrides.
	workload_json trainer deployment 2 --prefer "$NODE" | k apply -f - >/dev/null ||
		{ REASON="Deployment trainer not accepted"; return 1; }
	wait_until 60 trainer_running_on "$NODE" || { REASON="trainer not Running on $NODE: $(trainer_summary)"; return 1; }
	check_devices "$(trainer_pod)" 2 "$NODE" || return 1
	if ! k drain "$NODE" --ignore-daemonsets --delete-emptydir-data --timeout=90s >"$T/logs/drain.log" 2>&1; then
		REASON="drain of $NODE failed: $(tail -2 "$T/logs/drain.log" | paste -sd'|')"
		k uncordon "$NODE" >/dev/null
		return 1
	fi
	wait_until 60 trainer_running_on "$FLEET_B" || { REASON="trainer's replacement not Running on $FLEET_B: $(trainer_summary)"; k uncordon "$NODE" >/dev/null; return 1; }
	pod=$(trainer_pod)
	check_devices "$pod" 2 "$FLEET_B" || { k uncordon "$NODE" >/dev/null; return 1; }
	k uncordon "$NODE" >/dev/null
	fleet_node_serves "$NODE" || return 1
	CASE_DETAIL="replacement $pod on $FLEET_B with [${POD_IDS[*]}]; $NODE back to $(allocatable "$NODE") allocatable"
	k delete deployment trainer --wait >/dev/null
	wait_until 60 no_trainer
}

trainer_pod() {
	k get pods -l app=trainer -o json 2>/dev/null | python3 -c '
import json, sys
pods = [p for p in json.load(sys.stdin)["items"] if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"]
print(pods[0]["metadata"]["name"] if len(pods) == 1 else "")'
}

trainer_running_on() { local p; p=$(trainer_pod) && [[ -n $p && $(node_of "$p") == "$1" ]]; }

trainer_summary() { k get pods -l app=trainer -o wide --no-headers 2>&1 | paste -sd'|'; }

no_trainer() { [[ -z $(k get pods -l app=trainer -o name 2>/dev/null) ]]; }

# plugin_nodes: the nodes with a plugin pod that is not terminating, sorted, on one line.
plugin_nodes() {
	kns get pods -l app.kubernetes.io/name=efa-device-plugin -o json 2>/dev/null | python3 -c '
import json, sys
print(" ".join(sorted(p["spec"].get("nodeName", "?") for p in json.load(sys.stdin)["items"]
                      if not p["metadata"].get("deletionTimestamp"))))'
}

plugin_nodes_are() { [[ $(plugin_nodes) == "$1" ]]; }

# labelled_scope_follows_label INSTALL: with the plugin installed by INSTALL
# (a command) and efa-a and efa-b labelled, a plugin pod on those two only;
# plain labelled, one starts there; its label removed, it goes.
labelled_scope_follows_label() {
	local install=$1 want
	want=$(printf '%s\n' "$NODE" "$FLEET_B" | sort | paste -sd' ')
	k label node "${FLEET[@]}" "$SCOPE_LABEL-" >/dev/null 2>&1
	k label node "$NODE" "$FLEET_B" "$SCOPE_LABEL=true" >/dev/null || { REASON="cannot label the EFA nodes"; return 1; }
	"$install" && fleet_serving "$NODE" "$FLEET_B" || return 1
	if ! plugin_nodes_are "$want"; then
		REASON="$install: plugin pods on [$(plugin_nodes)], want [$want]"
		return 1
	fi
	k label node "$FLEET_PLAIN" "$SCOPE_LABEL=true" >/dev/null
	wait_until 60 has_ready_plugin_pod "$FLEET_PLAIN" || { REASON="$install: no plugin pod on $FLEET_PLAIN 60s after its label"; return 1; }
	k label node "$FLEET_PLAIN" "$SCOPE_LABEL-" >/dev/null
	wait_until 60 plugin_nodes_are "$want" || { REASON="$install: plugin pods on [$(plugin_nodes)] 60s after $FLEET_PLAIN lost its label, want [$want]"; return 1; }
}

install_labelled_chart() { fleet_chart --set nodeScope.mode=labelled; }

install_labelled_kustomize() {
	ensure_fleet && uninstall_plugin || return 1
	k apply -k "$HERE/cluster/kustomize/labelled" >/dev/null && return 0
	REASON="kubectl apply -k rejected the labelled overlay"
	return 1
}

case_fleet_labelled() {
	local ok=0
	labelled_scope_follows_label install_labelled_chart &&
		labelled_scope_follows_label install_labelled_kustomize && ok=1
	k label node "${FLEET[@]}" "$SCOPE_LABEL-" >/dev/null 2>&1
	((ok)) || return 1
	CASE_DETAIL="chart and kustomize: pods on [$NODE $FLEET_B], one on $FLEET_PLAIN while labelled"
	uninstall_plugin
}

# watch_fleet FILE: about once a second (one API call and half a second's
# sleep), a sample of every node of the fleet into FILE (lib/fleet_watch.py
# says what it holds), until stopped.
watch_fleet() {
	while :; do
		kns get nodes,pods -o json 2>/dev/null | python3 "$HERE/lib/fleet_watch.py" sample "$RESOURCE" >>"$1"
		sleep 0.5
	done
}

# holder_listing POD: what POD's container sees in /dev/infiniband now.
holder_listing() { k exec "$1" -- ls -l /dev/infiniband 2>/dev/null | listing_entries; }

case_fleet_rollout() {
	local before_a before_b detail
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	start_pod hold-a 2 "$NODE" && start_pod hold-b 4 "$FLEET_B" || return 1
	before_a="$(pod_field hold-a '{.metadata.uid}') $(holder_listing hold-a | paste -sd';')"
	before_b="$(pod_field hold-b '{.metadata.uid}') $(holder_listing hold-b | paste -sd';')"
	start_daemon rollout-watch watch_fleet "$T/rollout"
	sleep 2
	ours_helm upgrade --set config.log-level=debug >/dev/null || { REASON="helm upgrade failed"; stop_daemon rollout-watch; return 1; }
	if ! kns rollout status "daemonset/$DS" --timeout=300s >"$T/logs/rollout-status.log" 2>&1 || ! fleet_serving "${FLEET[@]}"; then
		stop_daemon rollout-watch
		REASON="the rollout did not complete within 300s: ${REASON:-$(tail -1 "$T/logs/rollout-status.log")}; last: $(tail -"${#FLEET[@]}" "$T/rollout" | paste -sd'|'); $(kns get pods -o wide --no-headers | paste -sd'|')"
		return 1
	fi
	sleep 2
	stop_daemon rollout-watch
	if ! detail=$(python3 "$HERE/lib/fleet_watch.py" rollout "$T/rollout" "$NODE=${NODE_EFAS[$NODE]}" \
		"$FLEET_B=${NODE_EFAS[$FLEET_B]}" "$FLEET_PLAIN=${NODE_EFAS[$FLEET_PLAIN]}" "$((NODE_STATUS_PERIOD + 30))"); then
		REASON=$detail
		return 1
	fi
	if [[ "$(pod_field hold-a '{.metadata.uid}') $(holder_listing hold-a | paste -sd';')" != "$before_a" ||
		"$(pod_field hold-b '{.metadata.uid}') $(holder_listing hold-b | paste -sd';')" != "$before_b" ]]; then
		REASON="a holder changed across the rollout: hold-a [$before_a] -> [$(holder_listing hold-a | paste -sd';')], hold-b -> [$(holder_listing hold-b | paste -sd';')]"
		return 1
	fi
	if [[ $(pod_field hold-a '{.status.containerStatuses[0].restartCount}') != 0 || $(pod_field hold-b '{.status.containerStatuses[0].restartCount}') != 0 ]]; then
		REASON="a holder's container restarted during the rollout"
		return 1
	fi
	CASE_DETAIL="$detail; holders kept their devices"
	k delete pod hold-a hold-b --wait >/dev/null
}

# fleet_targets_up: Prometheus scrapes the plugin pod of every node of the fleet.
fleet_targets_up() {
	local node ip up
	up=$(prom targets "$PROMETHEUS_URL" "$PROMETHEUS_JOB" 2>/dev/null)
	for node in "${FLEET[@]}"; do
		ip=$(pod_field "$(ready_plugin_pod "$node")" '{.status.podIP}' "$NS")
		[[ -n $ip ]] && grep -q "^up http://$ip:9465/metrics " <<<"$up" || return 1
	done
}

# query_lines EXPR LABEL...: EXPR's result, one "LABEL-values value" line per
# series, sorted.
query_lines() {
	local expr=$1
	shift
	prom query "$PROMETHEUS_URL" "$expr" 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    labels, value = line.rsplit(" ", 1)
    labels = json.loads(labels)
    print(" ".join([labels.get(k, "-") for k in sys.argv[1:]] + [value.strip()]))' "$@" | sort
}

case_fleet_metrics() {
	local want got
	fleet_chart && fleet_serving "${FLEET[@]}" || return 1
	start_pod hold-a 2 "$NODE" && start_pod hold-b 4 "$FLEET_B" || return 1
	ensure_prometheus || return 1
	wait_until 60 fleet_targets_up || { REASON="Prometheus does not scrape every node's plugin: $(prom targets "$PROMETHEUS_URL" "$PROMETHEUS_JOB" 2>&1 | paste -sd'|')"; return 1; }
	# Each plugin names its own node's holders only: the scraped pod's node is the holder's.
	want=$(printf '%s default hold-a 2\n%s default hold-b 4\n' "$NODE" "$FLEET_B" | sort)
	if ! wait_until 60 query_is "count by (node, namespace, pod) (efa_device_allocation)" "$want" node namespace pod; then
		REASON="efa_device_allocation by the scraped node: [$(query_lines "count by (node, namespace, pod) (efa_device_allocation)" node namespace pod | paste -sd'|')], want [$(paste -sd'|' <<<"$want")]"
		return 1
	fi
	# The README's per-pod count: one series per holder, whichever node it runs on.
	want=$(printf 'default hold-a 2\ndefault hold-b 4\n')
	got=$(query_lines "count by (namespace, pod) (efa_device_allocation)" namespace pod)
	[[ $got == "$want" ]] || { REASON="count by (namespace, pod) (efa_device_allocation): [$(paste -sd'|' <<<"$got")], want [$(paste -sd'|' <<<"$want")]"; return 1; }
	# The README's per-node capacity: one series per node, with its count.
	want=$(for n in "${FLEET[@]}"; do echo "$n ${NODE_EFAS[$n]}"; done | sort)
	got=$(query_lines 'sum by (node) (efa_device_plugin_devices{health="healthy"})' node)
	[[ $got == "$want" ]] || { REASON="healthy EFAs by node: [$(paste -sd'|' <<<"$got")], want [$(paste -sd'|' <<<"$want")]"; return 1; }
	CASE_DETAIL="3 targets; holders by node [$(query_lines "count by (node, pod) (efa_device_allocation)" node pod | paste -sd',')]; healthy by node [$(paste -sd',' <<<"$got")]"
	k delete pod hold-a hold-b --wait >/dev/null
}

query_is() { [[ $(query_lines "$1" "${@:3}") == "$2" ]]; }

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
	run_case "(F1) one plugin per node: chart defaults, Ready on all 3 nodes, each node's own IDs and count" case_fleet_one_plugin_per_node
	run_case "(F2) labelled mode, chart and kustomize: plugin pods only on labelled nodes; a label added starts one, removed stops it" case_fleet_labelled
	run_case "(F3) placement: 5 lands on $FLEET_B, 17 stays Pending though the fleet has 20, pods of 4 fill $NODE with one" case_fleet_placement
	run_case "(F4) rollout across nodes: never two nodes without a plugin, allocatable back, holders keep their devices" case_fleet_rollout
	run_case "(F5) a node that joins late: node Ready to plugin, allocatable and a waiting pod Running, this plugin and the AWS stand-in" case_fleet_late_join
	run_case "(F6) $NODE rebooted: kubelet start to Register, and what became of the pods holding EFAs there" case_fleet_reboot
	run_case "(F7) isolation: $NODE's kubelet restarted and plugin killed; $FLEET_B's allocatable, holder and registrations unchanged" case_fleet_isolation
	run_case "(F8) one Prometheus, every node's plugin: each names its own node's holders; the README's queries per pod and per node" case_fleet_metrics
	run_case "(F9) drain $NODE: the Deployment's replacement runs on $FLEET_B with its EFAs; uncordoned, $NODE back to 4" case_fleet_drain
}
