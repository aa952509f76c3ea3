# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# The soak: the fleet of cluster/fleet.sh, the chart in cdi mode, a workload
# that never stops changing, and a seeded random sequence of day-two events:
# the plugin rolled out, its container killed, a kubelet restarted, an EFA's
# uverbs node removed and restored, a node rebooted. After each event it
# waits for the fleet to recover and times it, then checks the invariants
# from the ground truth, not from the plugin's view (lib/soak_truth.py):
#   - no uverbs node is inside running containers of two pods;
#   - what the kubelet's PodResources says each container holds is what is
#     inside it;
#   - allocatable is back to each node's count within SOAK_RECOVERY seconds;
#   - every failed pod is a known kubelet behaviour (below);
#   - each node has one registered endpoint, and the CDI spec is there;
#   - the plugin's RSS and open fds: their slopes are reported.
# The detector (efa_device_plugin_double_booked_devices) is read beside the
# ground truth. A report goes to the log (logs/soak-report.txt) and its last
# line to the case's line: "soak: N cycles, E events, P pods, V violations".
#
#   EFA_DP_SOAK_CYCLES  cycles (default 6, CI's short soak; one event each)
#   EFA_DP_SOAK_SEED    the seed of the workload and the events (default 27,
#                       whose first six events are every kind, on both nodes)
#
# Sourced by cluster.sh, after cluster/fleet.sh, whose helpers it uses.
# shellcheck disable=SC2153 # NODE is cluster.sh's

SOAK_CYCLES=${EFA_DP_SOAK_CYCLES:-6}
SOAK_SEED=${EFA_DP_SOAK_SEED:-27}
SOAK_EVENTS=(rollout kill kubelet flap reboot)
# Workload pods alive at once, and their lifetimes in seconds.
SOAK_PODS=6
SOAK_LIFE_MIN=5
SOAK_LIFE_MAX=40
SOAK_RECOVERY=90
# What the kubelet is known to do to pods on a node whose kubelet just
# started (a restart or a reboot), each a kind of failure the report counts:
#   admission: refused before the plugin registered again (kubernetes #125579,
#     #128043 after a reboot, #138446 after a restart);
#   reboot: a container the reboot killed, which a pod that never restarts
#     does not get back (exit 137, or ContainerStatusUnknown when the kubelet
#     found it gone).
SOAK_KNOWN_ADMISSION='Allocate failed due to (no healthy devices present; cannot allocate unhealthy devices|cannot allocate unregistered device)'
SOAK_KNOWN_KILL='^(ContainerStatusUnknown|Error/137)$'
PODRESOURCES=
# The chart as both cases run it.
SOAK_CHART=(--set cdi.enabled=true)

declare -A SOAK_EXPIRY=() SOAK_EVENT_COUNT=() SOAK_KUBELET_START=()
SOAK_VIOLATIONS=0
SOAK_PODS_RUN=0

soak_note() { echo "$*" >>"$SOAK_REPORT"; }

soak_violation() {
	SOAK_VIOLATIONS=$((SOAK_VIOLATIONS + 1))
	soak_note "VIOLATION cycle $SOAK_CYCLE: $*"
}

# soak_rand N: RAND, a number in [0, N) from the soak's seeded generator; never
# in a subshell, whose draws the next one would repeat.
RAND=0
soak_rand() { RAND=$((RANDOM % $1)); }

# podresources_tool: the PodResources lister (tests/e2e/podresources), built once per run.
podresources_tool() {
	[[ -n $PODRESOURCES ]] && return 0
	PODRESOURCES=$(stub_plugin "$CACHE" "$HERE/podresources" podresources "$HERE/podreslist" 2>"$T/logs/podresources-build.log") && return 0
	PODRESOURCES=
	REASON="building the PodResources lister failed: $(tail -3 "$T/logs/podresources-build.log" | paste -sd'|')"
	return 1
}

node_cgroup_root() { if [[ -n ${NODE_HOLDER[$1]:-} ]]; then echo "/efa-e2e-$1"; else echo /; fi; }

# ---------------------------------------------------------------- workload

# soak_churn: expired pods deleted, finished Jobs deleted, and new pods and
# Jobs, each asking for 1 to 4 EFAs, made until SOAK_PODS are alive.
soak_churn() {
	local name live n kind life
	for name in "${!SOAK_EXPIRY[@]}"; do
		if ((SECONDS >= SOAK_EXPIRY[$name])); then
			k delete pod "$name" --wait=false >/dev/null 2>&1
			unset "SOAK_EXPIRY[$name]"
		fi
	done
	k delete jobs -l soak=1 --field-selector status.successful=1 --wait=false >/dev/null 2>&1
	live=$(k get pods -l soak=1 -o json 2>/dev/null | python3 -c '
import json, sys
print(sum(1 for p in json.load(sys.stdin)["items"]
          if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running")))')
	for ((n = live; n < SOAK_PODS; n++)); do
		SOAK_PODS_RUN=$((SOAK_PODS_RUN + 1))
		name=soak-$SOAK_PODS_RUN
		soak_rand $((SOAK_LIFE_MAX - SOAK_LIFE_MIN + 1))
		life=$((SOAK_LIFE_MIN + RAND))
		soak_rand 2
		kind=pod
		((RAND)) && kind=job
		soak_rand 4
		soak_workload "$name" "$kind" $((1 + RAND)) "$life" || soak_violation "$kind $name not accepted"
		[[ $kind == pod ]] && SOAK_EXPIRY[$name]=$((SECONDS + life))
	done
}

# soak_workload NAME KIND COUNT LIFE: a pod (deleted by soak_churn after LIFE
# seconds) or a Job whose container exits after LIFE seconds, asking for COUNT EFAs.
soak_workload() {
	local name=$1 kind=$2 count=$3 life=$4 sleep=100000
	[[ $kind == job ]] && sleep=$life
	workload_json "$name" "$kind" "$count" --sleep "$sleep" --label soak=1 | k apply -f - >/dev/null
}

# ---------------------------------------------------------------- events

# soak_event KIND NODE: one day-two event on NODE (rollout: on every node),
# done when what it set off has happened: the rollout complete, the plugin
# restarted, the kubelet's log showing the plugin registered again.
soak_event() {
	local kind=$1 node=$2 pod i dir count restarts log mark
	log=$T/logs/kubelet-$node.log
	case $kind in
	rollout)
		ours_helm upgrade "${SOAK_CHART[@]}" --set-string "additionalPodAnnotations.soak=$SOAK_CYCLE" >/dev/null &&
			kns rollout status "daemonset/$DS" --timeout="${SOAK_RECOVERY}s" >/dev/null
		;;
	kill)
		pod=$(ready_plugin_pod "$node")
		restarts=$(pod_field "$pod" '{.status.containerStatuses[0].restartCount}' "$NS")
		ctr_on "$node" tasks kill -s SIGKILL "$(plugin_container_id "$pod")" >/dev/null 2>&1 &&
			wait_until "$SOAK_RECOVERY" restarted_more_than "$pod" "$restarts"
		;;
	kubelet)
		mark=$(wc -l <"$log")
		stop_daemon "kubelet-$node"
		SOAK_KUBELET_START[$node]=$SECONDS
		start_node_kubelet "$node" && wait_until "$SOAK_RECOVERY" registration_logged "$log" "$mark" >/dev/null
		;;
	flap)
		count=${NODE_EFAS[$node]}
		soak_rand "$count"
		i=$RAND
		dir=$(node_host_path "$node" /dev/infiniband)
		mv "$dir/uverbs$i" "$dir/.uverbs$i" &&
			wait_until $((NODE_STATUS_PERIOD + 10)) allocatable_is $((count - 1)) "$node"
		mv "$dir/.uverbs$i" "$dir/uverbs$i"
		;;
	reboot)
		mark=$(wc -l <"$log")
		stop_node "$node"
		SOAK_KUBELET_START[$node]=$SECONDS
		start_node "$node" && wait_until "$SOAK_RECOVERY" registration_logged "$log" "$mark" >/dev/null
		;;
	esac
}

restarted_more_than() { (($(pod_field "$1" '{.status.containerStatuses[0].restartCount}' "$NS") > $2)); }

# soak_recovered: each EFA node with a Ready plugin, its count allocatable,
# one registered endpoint, and the CDI spec.
soak_recovered() {
	local node
	for node in "$NODE" "$FLEET_B"; do
		has_ready_plugin_pod "$node" && allocatable_is "${NODE_EFAS[$node]}" "$node" &&
			[[ -s $(node_host_path "$node" /run/cdi/vpc.amazonaws.com-efa.json) ]] || return 1
	done
}

# ---------------------------------------------------------------- invariants

# soak_truth: the ground truth against each node's PodResources, as
# soak_truth.py prints it.
soak_truth() {
	local node args=()
	for node in "$NODE" "$FLEET_B"; do
		"$PODRESOURCES" --socket "$(node_host_path "$node" /var/lib/kubelet/pod-resources/kubelet.sock)" >"$T/soak-podres-$node" 2>>"$T/logs/soak-podres.log" ||
			echo "podresources-failed $node"
		args+=("$node=$(node_cgroup_root "$node"):$(node_sysfs "$node"):$T/soak-podres-$node")
	done
	k get pods -A -o json | python3 "$HERE/lib/soak_truth.py" truth "${args[@]}"
}

# A restarted kubelet's PodResources lists the containers it runs only once
# it has synced its pods again: a difference must outlast this many seconds.
SOAK_PODRESOURCES_SETTLE=20

# soak_check: the ground truth against PodResources, double bookings against
# the detector, failed pods classified, endpoints counted, RSS and fds sampled.
soak_check() {
	local node out truth detector=0 v pod pid waited=0
	out=$(soak_truth)
	while grep -qE '^(differs|podresources-failed) ' <<<"$out" && ((waited < SOAK_PODRESOURCES_SETTLE)); do
		sleep 2
		waited=$((waited + 2))
		out=$(soak_truth)
	done
	((waited == 0)) || soak_note "cycle $SOAK_CYCLE: PodResources caught up with the containers after ${waited}s"
	while read -r v; do
		[[ $v == truth* ]] && { truth=$v; continue; }
		[[ -n $v ]] && soak_violation "$v"
	done <<<"$out"
	for node in "$NODE" "$FLEET_B"; do
		pod=$(ready_plugin_pod "$node")
		v=$(metric "$pod" efa_device_plugin_double_booked_devices 2>/dev/null)
		detector=$((detector + ${v:-0}))
		v=$(find "$(node_dp_dir "$node")" -maxdepth 1 -name '*.sock' ! -name kubelet.sock | wc -l)
		((v == 1)) || soak_violation "$node has $v registered endpoint sockets"
		pid=$(ctr_on "$node" tasks ls 2>/dev/null | awk -v id="$(plugin_container_id "$pod")" '$1 == id { print $2 }')
		if [[ -n $pid && -r /proc/$pid/status ]]; then
			echo "$SOAK_CYCLE $pid $(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status")" >>"$T/soak-rss-$node"
			echo "$SOAK_CYCLE $pid $(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 | wc -l)" >>"$T/soak-fds-$node"
		fi
	done
	SOAK_TRUTH_DOUBLES=$((SOAK_TRUTH_DOUBLES + ${truth##* }))
	SOAK_DETECTOR_DOUBLES=$((SOAK_DETECTOR_DOUBLES + detector))
	soak_classify_failures
}
SOAK_TRUTH_DOUBLES=0
SOAK_DETECTOR_DOUBLES=0

# soak_classify_failures: every failed workload pod, once: a refusal the
# kubelet is known to make right after it started (SOAK_KNOWN_ADMISSION,
# within SOAK_RECOVERY of a kubelet start on the pod's node) is counted by
# kind; anything else is a violation. Failed pods are deleted once read.
declare -A SOAK_FAILURES=()
soak_classify_failures() {
	local name node job reason message ended started kind
	while IFS=$'\t' read -r name node job reason message ended; do
		[[ -n $name ]] || continue
		started=${SOAK_KUBELET_START[$node]:--100000}
		kind=
		if ((SECONDS - started <= SOAK_RECOVERY + 60)); then
			[[ $reason == UnexpectedAdmissionError && $message =~ $SOAK_KNOWN_ADMISSION ]] && kind=admission
			[[ $ended =~ $SOAK_KNOWN_KILL ]] && kind=reboot
		fi
		if [[ -n $kind ]]; then
			SOAK_FAILURES[$kind]=$((${SOAK_FAILURES[$kind]:-0} + 1))
		else
			soak_violation "unclassified failure: pod $name on $node: $reason: $message; container: $ended"
		fi
		if [[ $job != - ]]; then
			k delete job "$job" --wait=false >/dev/null 2>&1
		else
			k delete pod "$name" --wait=false >/dev/null 2>&1
			unset "SOAK_EXPIRY[$name]"
		fi
	done < <(k get pods -l soak=1 --field-selector status.phase=Failed -o json 2>/dev/null | python3 -c '
import json, sys
for p in json.load(sys.stdin)["items"]:
    st = p["status"]
    ended = "-"
    for c in st.get("containerStatuses") or []:
        t = (c.get("state") or {}).get("terminated")
        if t:
            ended = t.get("reason", "?") if t.get("reason") != "Error" else "Error/" + str(t.get("exitCode"))
    print("\t".join([p["metadata"]["name"], p["spec"].get("nodeName", "-"), p["metadata"].get("labels", {}).get("job-name", "-"),
                     st.get("reason", "-"), (st.get("message") or "-").replace("\t", " ").replace("\n", " "), ended]))')
}

# ---------------------------------------------------------------- the case

# soak_plan: each cycle's pause, event and node, drawn first from the seed, so
# that the events are the seed's whatever the timing; the workload's draws
# follow (how many it makes depends on what finished when).
declare -a SOAK_PLAN_KIND=() SOAK_PLAN_NODE=() SOAK_PLAN_PAUSE=()
soak_plan() {
	local cycle
	RANDOM=$SOAK_SEED
	for ((cycle = 1; cycle <= SOAK_CYCLES; cycle++)); do
		soak_rand 5
		SOAK_PLAN_PAUSE[cycle]=$((2 + RAND))
		soak_rand ${#SOAK_EVENTS[@]}
		SOAK_PLAN_KIND[cycle]=${SOAK_EVENTS[$RAND]}
		soak_rand 2
		SOAK_PLAN_NODE[cycle]=$NODE
		((RAND)) && SOAK_PLAN_NODE[cycle]=$FLEET_B
	done
}

case_soak() {
	local kind node start ms events=0
	SOAK_REPORT=$T/logs/soak-report.txt
	podresources_tool || return 1
	fleet_chart "${SOAK_CHART[@]}" && fleet_serving "${FLEET[@]}" || return 1
	soak_plan
	: >"$SOAK_REPORT"
	: >"$T/soak-recovery"
	soak_note "soak: seed $SOAK_SEED, $SOAK_CYCLES cycles, Kubernetes $KUBE_VERSION, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
	for ((SOAK_CYCLE = 1; SOAK_CYCLE <= SOAK_CYCLES; SOAK_CYCLE++)); do
		soak_churn
		sleep "${SOAK_PLAN_PAUSE[$SOAK_CYCLE]}"
		kind=${SOAK_PLAN_KIND[$SOAK_CYCLE]}
		node=${SOAK_PLAN_NODE[$SOAK_CYCLE]}
		start=$EPOCHREALTIME
		ms=
		soak_event "$kind" "$node" || soak_violation "$kind on $node did not complete"
		if wait_until "$SOAK_RECOVERY" soak_recovered; then
			ms=$(since_ms "$start")
			echo "$kind $ms" >>"$T/soak-recovery"
		else
			soak_violation "$kind on $node: not recovered within ${SOAK_RECOVERY}s"
		fi
		events=$((events + 1))
		SOAK_EVENT_COUNT[$kind]=$((${SOAK_EVENT_COUNT[$kind]:-0} + 1))
		soak_note "cycle $SOAK_CYCLE: $kind on $node, recovered in ${ms:-?} ms"
		soak_check
	done
	soak_report "$events"
	k delete pods,jobs -l soak=1 --wait=false >/dev/null 2>&1
	soak_verdict "$(tail -1 "$SOAK_REPORT")"
}

# soak_verdict LINE: the case's line, LINE and the report's name; a failure
# naming the first three violations if there were any.
soak_verdict() {
	CASE_DETAIL="$1 (report: logs/${SOAK_REPORT##*/})"
	((SOAK_VIOLATIONS == 0)) && return 0
	REASON="$1: $(grep -m3 '^VIOLATION' "$SOAK_REPORT" | paste -sd'|')"
	return 1
}

soak_report() {
	local events=$1 kind node
	soak_note "events by kind: $(for kind in "${!SOAK_EVENT_COUNT[@]}"; do printf '%s %s, ' "$kind" "${SOAK_EVENT_COUNT[$kind]}"; done)"
	soak_note "recovery by kind (n, median ms, p99 ms): $(python3 "$HERE/lib/soak_truth.py" quantiles "$T/soak-recovery" | paste -sd';')"
	soak_note "failures classified: $(for kind in "${!SOAK_FAILURES[@]}"; do printf '%s %s, ' "$kind" "${SOAK_FAILURES[$kind]}"; done)"
	soak_note "double-booked devices, summed over checks: ground truth $SOAK_TRUTH_DOUBLES, detector $SOAK_DETECTOR_DOUBLES"
	for node in "$NODE" "$FLEET_B"; do
		[[ -f $T/soak-rss-$node ]] || continue
		soak_note "$node plugin: RSS slope $(python3 "$HERE/lib/soak_truth.py" slope "$T/soak-rss-$node" | awk '{ print $1 " KiB/cycle over " $2 " samples" }'), fd slope $(python3 "$HERE/lib/soak_truth.py" slope "$T/soak-fds-$node" | awk '{ print $1 "/cycle over " $2 " samples" }')"
	done
	soak_note "soak: $SOAK_CYCLES cycles, $events events, $SOAK_PODS_RUN pods, $SOAK_VIOLATIONS violations"
}

# ---------------------------------------------------------------- the admission burst

# Kubernetes PR #137534 (fixed in 1.38): a PodResources List that runs while
# an Allocate is in flight, and finds a pod that has just ended, rebuilds the
# kubelet's allocated set without the EFAs being given out; the next
# admission may then get the same EFAs. The burst makes that as likely as the
# fleet can: pods of 1 EFA each, short-lived, admitted many at once as others
# end, and each kubelet's List called BURST_RATE times a second beside the
# plugin's own poll. It samples the ground truth throughout and holds the
# detector to it: every double booking the ground truth sees for at least two
# of the plugin's polls must be one the plugin warned of. A double booking
# itself is the kubelet's: reported, not failed.
#   EFA_DP_BURST_PODS  pods in all (default 60)
BURST_PODS=${EFA_DP_BURST_PODS:-60}
BURST_QUEUE=10
BURST_LIFE_MIN=3
BURST_LIFE_MAX=20
# The kubelet serves 100 a second in all; the rest is the plugin's poll's.
BURST_RATE=80
# The plugin's poll, values-e2e.yaml's rescan interval: it warns of a double
# booking that two answers in a row show.
BURST_POLL=5

# burst_top_up LIVE: new pods, in one List, so that the fleet's EFAs and
# BURST_QUEUE more are asked for, until BURST_PODS are made (BURST_MADE).
BURST_MADE=0
burst_top_up() {
	local want=$((FLEET_EFAS + BURST_QUEUE - $1)) pods=() life
	while ((want-- > 0 && BURST_MADE < BURST_PODS)); do
		BURST_MADE=$((BURST_MADE + 1))
		soak_rand $((BURST_LIFE_MAX - BURST_LIFE_MIN + 1))
		life=$((BURST_LIFE_MIN + RAND))
		pods+=("burst-$BURST_MADE pod 1 --sleep $life --label burst=1")
	done
	((${#pods[@]})) || return 0
	printf '%s\n' "${pods[@]}" | workload_json --each | k apply -f - >/dev/null ||
		soak_violation "burst pods up to burst-$BURST_MADE not accepted"
}

# burst_pods: "name phase node" of every burst pod.
burst_pods() {
	k get pods -l burst=1 -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase} {.spec.nodeName}{"\n"}{end}' 2>/dev/null
}

# burst_alloc_calls NODE: "count sum" of the kubelet's Allocate calls to
# device plugins (kubelet_device_plugin_alloc_duration_seconds).
burst_alloc_calls() {
	k get --raw "/api/v1/nodes/$1/proxy/metrics" 2>/dev/null | awk -v r="$RESOURCE" '
		index($0, "kubelet_device_plugin_alloc_duration_seconds_") == 1 && index($0, "resource_name=\"" r "\"") {
			if ($1 ~ /_count/) c = $NF; if ($1 ~ /_sum/) s = $NF }
		END { print c + 0, s + 0 }'
}

case_burst() {
	local node start since live phase name ended hammers=() failed=0 samples=0 line pairs
	SOAK_REPORT=$T/logs/burst-report.txt
	SOAK_VIOLATIONS=0
	SOAK_CYCLE=burst
	podresources_tool || return 1
	# Each GetPreferredAllocation offer and answer logged, to see the kubelet offer an ID again.
	fleet_chart "${SOAK_CHART[@]}" --set-string 'config.log-level=info\,efa_device_plugin::allocation=debug' &&
		fleet_serving "${FLEET[@]}" || return 1
	local a=${NODE_EFAS[$NODE]} b=${NODE_EFAS[$FLEET_B]}
	FLEET_EFAS=$((a + b))
	RANDOM=$SOAK_SEED
	: >"$SOAK_REPORT"
	: >"$T/burst-truth"
	: >"$T/burst-allocs"
	for node in "$NODE" "$FLEET_B"; do
		echo "before $node $(burst_alloc_calls "$node")" >>"$T/burst-allocs"
		"$PODRESOURCES" --socket "$(node_host_path "$node" /var/lib/kubelet/pod-resources/kubelet.sock)" \
			--repeat-for 30m --rate "$BURST_RATE" >"$T/burst-lists-$node" 2>&1 &
		hammers+=($!)
	done
	since=$(date -u +%Y-%m-%dT%H:%M:%SZ)
	start=$SECONDS
	while ((SECONDS - start < BURST_PODS * 3 + 60)); do
		live=0
		ended=()
		while read -r name phase node; do
			case $phase in
			Pending | Running) live=$((live + 1)) ;;
			Succeeded) ended+=("$name") ;;
			Failed)
				failed=$((failed + 1))
				soak_violation "burst pod $name failed on $node: $(pod_field "$name" '{.status.reason}: {.status.message}')"
				ended+=("$name")
				;;
			esac
		done < <(burst_pods)
		((${#ended[@]} == 0)) || k delete pods "${ended[@]}" --wait=false >/dev/null 2>&1
		((live == 0 && BURST_MADE == BURST_PODS)) && break
		burst_top_up "$live"
		soak_truth | sed -n "s/^double /$SECONDS /p" >>"$T/burst-truth"
		samples=$((samples + 1))
	done
	kill -TERM "${hammers[@]}" 2>/dev/null
	wait "${hammers[@]}" 2>/dev/null
	((live == 0)) || soak_violation "$live burst pods still alive after $((SECONDS - start))s"
	k delete pods -l burst=1 --wait=false >/dev/null 2>&1
	for node in "$NODE" "$FLEET_B"; do
		echo "after $node $(burst_alloc_calls "$node")" >>"$T/burst-allocs"
		kns logs "$(ready_plugin_pod "$node")" --since-time="$since" >"$T/burst-log" 2>&1 ||
			soak_violation "the plugin's log on $node could not be read: $(head -1 "$T/burst-log")"
		sed "s/^/$node /" "$T/burst-log"
	done >"$T/logs/burst-plugin.log"
	soak_note "burst: seed $SOAK_SEED, $BURST_PODS pods in $((SECONDS - start))s, $failed failed, ground truth sampled $samples times, Kubernetes $KUBE_VERSION, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
	soak_note "List calls beside the plugin's poll, $BURST_RATE/s a kubelet: $(cat "$T/burst-lists-$NODE" "$T/burst-lists-$FLEET_B" | paste -sd';')"
	pairs=$(python3 "$HERE/lib/soak_truth.py" burst "$T/burst-truth" "$T/logs/burst-plugin.log" "$T/burst-allocs" $((2 * BURST_POLL)))
	while read -r line; do
		[[ $line == missed* ]] && soak_violation "the detector did not warn of $line"
		soak_note "$line"
	done <<<"$pairs"
	line="burst: $BURST_PODS pods, $(tail -1 <<<"$pairs"), $SOAK_VIOLATIONS violations"
	soak_note "$line"
	soak_verdict "$line"
}

soak_cases() {
	run_case "(S1) soak: workload churn and seeded day-two events on the fleet in cdi mode; no double booking, PodResources matches the inside" case_soak
	run_case "(S2) admission burst with PodResources listed hard (kubernetes PR #137534): the detector warns of every double booking the ground truth sees" case_burst
}
