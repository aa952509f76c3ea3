# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON is read by run_case (lib/host.sh)
# Workloads against the installed plugin: a Job gets exactly the EFAs the
# scheduler counted for it, a pod asking for more than the node has stays
# Pending, and the operator's CLI in the plugin pod. Sourced by cluster.sh;
# each case starts with ensure_plugin (lib/cluster.sh), so the arm64 group
# runs them again against whichever plugin it installed.

case_job() { ensure_plugin && run_job efa-job 2; }

case_over_ask() {
	local events
	ensure_plugin || return 1
	workload over-ask pod 5 >/dev/null || { REASON="pod over-ask not accepted"; return 1; }
	if ! wait_until 60 failed_scheduling over-ask; then
		REASON="no FailedScheduling event naming Insufficient $RESOURCE within 60s: phase $(pod_field over-ask '{.status.phase}'), events: $(pod_events over-ask)"
		return 1
	fi
	if ! pod_phase_is over-ask Pending; then
		REASON="pod over-ask is $(pod_field over-ask '{.status.phase}'), want Pending"
		return 1
	fi
	events=$(pod_events over-ask)
	note "over-ask: $events"
	k delete pod over-ask --wait >/dev/null
}

failed_scheduling() { pod_events "$1" | grep -q "FailedScheduling: .*Insufficient $RESOURCE"; }

case_operator_cli() {
	local pod out n=0 i
	ensure_plugin || return 1
	pod=$(ready_plugin_pod)
	if ! out=$(kns exec "$pod" -- /efa-device-plugin --sysfs-root "$SYSFS_IN_POD" list 2>&1); then
		REASON="kubectl exec $pod -- /efa-device-plugin list failed: $out"
		return 1
	fi
	# One row per EFA, naming it by its ID (the ibdev name) and its PCI address.
	for i in "${!EFA_BUSES[@]}"; do
		grep -E "^$(efa_ibdev "$i") .*$(efa_pci "$i")" <<<"$out" >/dev/null && n=$((n + 1))
	done
	if ((n != 4)); then
		REASON="list printed $n devices, want 4: $(paste -sd'|' <<<"$out")"
		return 1
	fi
	# The image is the binary alone: there is no shell to exec.
	if kns exec "$pod" -- sh -c true >/dev/null 2>&1; then
		REASON="the plugin image has a shell"
		return 1
	fi
}
