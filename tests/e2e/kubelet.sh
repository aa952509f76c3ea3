#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of efa-device-plugin against a real kubelet and containerd
# on this host. The EFAs are a fake p4d-shaped sysfs tree plus real character
# device nodes, so everything from discovery to the container's /dev is real
# except the hardware behind the nodes.
#
# Needs root. Prints one line per case and "N passed, M failed" last; exits
# non-zero on any failure. Leaves the host as it found it, also on failure.
#
# Environment:
#   EFA_DP_E2E_CACHE         where the kubelet build and its Go caches live
#                            (default /var/cache/efa-device-plugin-e2e)
#   EFA_DP_E2E_KUBE_VERSION  kubelet version to build (default in lib/build.sh)
set -uo pipefail

# shellcheck source=SCRIPTDIR/lib/suite.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/suite.sh"
source "$HERE/lib/standalone.sh"

SUITE=kubelet

# ---------------------------------------------------------------- setup

setup() {
	prepare_standalone
	make_fake_efa_host "$T/sys" "$T/dev" || fail_setup "cannot build the fake EFA host"
	# shellcheck disable=SC2119 # no config lines to add
	start_standalone
}

# ---------------------------------------------------------------- pods

# write_pod NAME COUNT [RESTART_POLICY SCRIPT]: a static pod asking for COUNT
# EFAs whose container records what it sees in /dev/infiniband, once at start
# and then every second, into $T/out/NAME/{ls,now}; or runs SCRIPT instead.
write_pod() {
	local name=$1 count=$2 policy=${3:-Never}
	local script=${4:-'ls -l /dev/infiniband >/out/ls 2>&1; while true; do ls -l /dev/infiniband >/out/now.tmp 2>&1; mv /out/now.tmp /out/now; sleep 1; done'}
	mkdir -p "$T/out/$name"
	cat >"$T/manifests.tmp/$name.json" <<-EOF
		{"apiVersion": "v1", "kind": "Pod",
		 "metadata": {"name": "$name", "namespace": "default"},
		 "spec": {
		  "hostNetwork": true, "restartPolicy": "$policy", "terminationGracePeriodSeconds": 1,
		  "containers": [{
		   "name": "probe", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
		   "command": ["sh", "-c", "$script"],
		   "resources": {"limits": {"$RESOURCE": $count}},
		   "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
		  "volumes": [{"name": "out", "hostPath": {"path": "$T/out/$name", "type": "Directory"}}]}}
	EOF
	# A rename, so the kubelet never reads a half-written manifest.
	mv "$T/manifests.tmp/$name.json" "$T/manifests/$name.json"
}

# wait_pod_running NAME COUNT: the pod runs, the checkpoint gives it COUNT
# devices, and its container saw exactly their nodes. Sets POD_IDS.
wait_pod_running() {
	local name=$1 count=$2 uid got want
	if ! wait_until 60 pod_phase_is "$name" Running; then
		REASON="pod $name not Running within 60s: $(pod_status "$name")"
		return 1
	fi
	uid=$(pod_status "$name" | cut -f3)
	read -ra POD_IDS <<<"$(allocated_ids "$uid")"
	if ((${#POD_IDS[@]} != count)); then
		REASON="checkpoint gives pod $name ${#POD_IDS[@]} devices [${POD_IDS[*]}], want $count"
		return 1
	fi
	if ! wait_until 20 test -s "$T/out/$name/ls"; then
		REASON="pod $name wrote no listing of /dev/infiniband"
		return 1
	fi
	got=$(listing_entries <"$T/out/$name/ls")
	want=$(expected_entries "${POD_IDS[@]}")
	if [[ $got != "$want" ]]; then
		REASON="pod $name sees [$(paste -sd';' <<<"$got")] in /dev/infiniband, want [$(paste -sd';' <<<"$want")]; raw: $(paste -sd'|' "$T/out/$name/ls")"
		return 1
	fi
}

# wait_pod_rejected NAME COUNT: admission rejects the pod, naming the resource.
wait_pod_rejected() {
	local name=$1 count=$2 status reason message
	if ! wait_until 60 pod_phase_is "$name" Failed; then
		REASON="pod $name asking for $count not Failed within 60s: $(pod_status "$name")"
		return 1
	fi
	status=$(pod_status "$name")
	reason=$(cut -f2 <<<"$status")
	message=$(cut -f4 <<<"$status")
	if [[ $reason != UnexpectedAdmissionError || $message != *"$RESOURCE"* ]]; then
		REASON="pod $name rejected with reason $reason, message: $message"
		return 1
	fi
	note "pod $name: $reason: $message"
}

# modified_since FILE EPOCH: FILE was written in a later second than EPOCH.
modified_since() { [[ -e $1 ]] && (($(stat -c %Y "$1") > $2)); }

# ---------------------------------------------------------------- fixtures

# ensure_plugin: the plugin runs on the fake host, started if it does not,
# and the kubelet's checkpoint lists its 4 IDs.
ensure_plugin() {
	alive_pid "$PLUGIN_PID" || start_plugin "$T/sys" "$T/dev"
	if ! wait_until 30 registered_is "$(efa_ibdevs)"; then
		REASON="checkpoint lists [$(registered_ids)] under $RESOURCE after 30s, want [$(efa_ibdevs)]; kubelet registrations: $(registrations); plugin log: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
}

alive_pid() { [[ -n $1 ]] && alive "$1"; }

# ensure_static_holder: the static pod "holder" runs with 2 EFAs, its
# manifest written if it is not there. It is the running pod the restart
# cases expect to keep its devices; the cluster suite's ensure_holder
# (lib/cluster.sh) is its counterpart through the API.
ensure_static_holder() {
	ensure_plugin || return 1
	pod_phase_is holder Running && return 0
	write_pod holder 2
	wait_pod_running holder 2
}

# ---------------------------------------------------------------- cases

case_registration() {
	ensure_plugin || return 1
	if (($(registrations) != 1)); then
		REASON="kubelet logged $(registrations) registrations of $RESOURCE, want 1"
		return 1
	fi
}

case_pod_sees_its_devices() {
	# The pod is the holder the restart cases reuse; room for it first.
	ensure_plugin && remove_pods holder || return 1
	write_pod holder 2
	wait_pod_running holder 2
}

case_over_ask_rejected() {
	ensure_plugin || return 1
	write_pod over-ask 5
	wait_pod_rejected over-ask 5 || return 1
	remove_pod over-ask
}

case_kubelet_restart() {
	# The holder keeps running across the restart, and leaves room for 2.
	ensure_static_holder && remove_pods holder || return 1
	stop_pid "$KUBELET_PID" 30
	if ! start_kubelet; then
		REASON="kubelet not healthy within 60s after restart: $(tail -3 "$(kubelet_log)" | paste -sd'|')"
		return 1
	fi
	# The restarted kubelet deleted the plugin's socket; the plugin has to
	# notice the new kubelet.sock and register again.
	if ! wait_until 60 registered_since 0 "$(efa_ibdevs)"; then
		REASON="plugin did not register with the restarted kubelet within 60s (registrations: $(registrations), checkpoint: [$(registered_ids)], dir: [$(find "$DP_DIR" -mindepth 1 -printf '%f ')]); plugin log: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	write_pod after-kubelet-restart 2
	wait_pod_running after-kubelet-restart 2
}

case_plugin_restart() {
	local ids_before holder_ids status restarted listing registrations_before
	local -a holder_devices
	ensure_static_holder && remove_pods holder || return 1
	ids_before=$(registered_ids)
	read -ra holder_devices <<<"$(allocated_ids "$(pod_status holder | cut -f3)")"
	holder_ids=$(expected_entries "${holder_devices[@]}")
	if ! alive "$PLUGIN_PID"; then
		stop_pid "$PLUGIN_PID" 0
		REASON="plugin had already exited with status $?: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	stop_pid "$PLUGIN_PID" 10
	status=$?
	if ((status != 0)); then
		REASON="plugin exited with status $status on SIGTERM: $(tail -3 "$(plugin_log)" | paste -sd'|')"
		return 1
	fi
	if [[ -e $PLUGIN_SOCKET ]]; then
		REASON="plugin left $PLUGIN_SOCKET behind on SIGTERM"
		return 1
	fi
	registrations_before=$(registrations)
	restarted=$(date +%s)
	start_plugin "$T/sys" "$T/dev"
	if ! wait_until 30 registered_since "$registrations_before" "$ids_before"; then
		REASON="after plugin restart: registrations $(registrations) (before $registrations_before), checkpoint [$(registered_ids)], want [$ids_before]"
		return 1
	fi
	if ! pod_phase_is holder Running; then
		REASON="pod holder no longer Running after plugin restart: $(pod_status holder)"
		return 1
	fi
	# The container rewrites "now" every second; wait for a rewrite that
	# started after the restart.
	if ! wait_until 10 modified_since "$T/out/holder/now" "$restarted"; then
		REASON="pod holder stopped refreshing its listing after plugin restart"
		return 1
	fi
	listing=$(listing_entries <"$T/out/holder/now")
	if [[ $listing != "$holder_ids" ]]; then
		REASON="pod holder now sees [$(paste -sd';' <<<"$listing")], had [$(paste -sd';' <<<"$holder_ids")]"
		return 1
	fi
	write_pod after-plugin-restart 2
	wait_pod_running after-plugin-restart 2
}

case_device_node_loss() {
	local last_id three
	last_id=$(efa_ibdev 3)
	# All 4 free, so the only thing short is the missing node.
	ensure_plugin && remove_pods || return 1
	three=$(efa_ibdevs 0 1 2)
	rm "$T/dev/infiniband/uverbs3"
	if ! wait_until 30 registered_is "$three"; then
		REASON="with $T/dev/infiniband/uverbs3 gone, checkpoint still lists [$(registered_ids)] after 30s, want [$three]"
		return 1
	fi
	write_pod four-of-three 4
	wait_pod_rejected four-of-three 4 || return 1
	remove_pod four-of-three
	make_uverbs_node "$T/dev" 3
	if ! wait_until 30 registered_is "$(efa_ibdevs)"; then
		REASON="with uverbs3 restored, checkpoint lists [$(registered_ids)] after 30s, want [$(efa_ibdevs)] ($last_id healthy again)"
		return 1
	fi
	write_pod four-restored 4
	wait_pod_running four-restored 4
}

# double_booked_stays_zero WHAT: over 3 s (6 polls of PodResources) the
# plugin counts no double-booked EFA; else REASON names WHAT.
double_booked_stays_zero() {
	local i value
	for i in 1 2 3 4 5 6; do
		value=$(plugin_metrics | awk '$1 == "efa_device_plugin_double_booked_devices" {print $2}')
		if [[ $value != 0 ]]; then
			REASON="$WHAT: efa_device_plugin_double_booked_devices is '$value', want 0; plugin log: $(grep -m3 'double-booked' "$(plugin_log)" | paste -sd'|')"
			return 1
		fi
		sleep 0.5
	done
}

# holds_in_view NAME COUNT: the plugin's PodResources view shows static pod
# NAME holding COUNT EFAs, so a gauge at 0 is a reading, not a blind spot.
holds_in_view() {
	(($(plugin_metrics | grep -c "^efa_device_allocation{.*pod=\"$1-$NODE\"") == $2))
}

restarts_of() { python3 "$HERE/lib/kubeinfo.py" restarts "http://127.0.0.1:$KUBELET_RO_PORT/pods" "$1-$NODE" 2>/dev/null; }
restarted_twice() { (($(restarts_of "$1") >= 2)); }

case_no_false_double_booking() {
	local WHAT
	ensure_plugin && remove_pods || return 1
	# A Job-like pod takes every EFA and completes; it stays in the kubelet's
	# pods, Succeeded, while a new pod gets the same 4 EFAs.
	write_pod job 4 Never 'ls -l /dev/infiniband >/out/ls 2>&1; sleep 2'
	if ! wait_until 60 pod_phase_is job Succeeded; then
		REASON="pod job not Succeeded within 60s: $(pod_status job)"
		return 1
	fi
	WHAT="completed pod" double_booked_stays_zero || return 1
	write_pod after-job 4
	wait_pod_running after-job 4 || return 1
	if ! wait_until 20 holds_in_view after-job 4; then
		REASON="the plugin's view never showed after-job with 4 EFAs: $(plugin_metrics | grep -c '^efa_device_allocation{') series"
		return 1
	fi
	WHAT="completed pod, then a new pod on its EFAs" double_booked_stays_zero || return 1
	# A container that keeps restarting keeps its 2 EFAs, next to a pod on
	# the other 2.
	remove_pods || return 1
	write_pod restarter 2 Always 'sleep 1; exit 1'
	write_pod beside 2
	wait_pod_running beside 2 || return 1
	if ! wait_until 90 restarted_twice restarter; then
		REASON="pod restarter restarted $(restarts_of restarter) times in 90s, want 2: $(pod_status restarter)"
		return 1
	fi
	if ! wait_until 20 holds_in_view restarter 2; then
		REASON="the plugin's view never showed restarter with 2 EFAs"
		return 1
	fi
	WHAT="restarted container" double_booked_stays_zero || return 1
	remove_pods
}

# ---------------------------------------------------------------- cleanup

cleanup() { stop_standalone; }

kubelet_cases() {
	run_case "registration: plugin registers; checkpoint lists 4 IDs" case_registration
	run_case "allocation: pod limited to 2 sees exactly its 2 uverbs nodes" case_pod_sees_its_devices
	run_case "over-ask: pod asking for 5 is rejected at admission" case_over_ask_rejected
	run_case "kubelet restart: the plugin re-registers; new pod runs" case_kubelet_restart
	run_case "plugin restart: IDs and running pod are intact; new pod runs" case_plugin_restart
	run_case "device loss: missing device node makes 4 unschedulable; restored node admits 4" case_device_node_loss
	run_case "no false double booking: completed pod then a new pod on its EFAs, restarted container" case_no_false_double_booking
}

run_suite kubelet_cases
