# shellcheck shell=bash disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# A cluster case, sourced by tests/e2e/cluster.sh; the helpers and fixtures
# are lib/cluster.sh's, CDI_SPEC is cluster/install.sh's.
#
# In cdi mode the kubelet restarts a container of a running pod from its
# checkpoint, without calling the plugin, and containerd resolves the
# container's CDI names from the plugin's spec file. So the spec must outlive
# the plugin while a container holds an EFA: this case stops the plugin under
# a holder, kills the holder's process, and expects the container back with
# its EFA.

# A marker that names the holder's process on the host.
CDI_HOLDER_SLEEP=100017

# cdi_holder: a pod that always restarts, holding 1 EFA; its container's
# process is "sleep $CDI_HOLDER_SLEEP".
cdi_holder() { workload_json cdi-holder pod 1 --restart Always --sleep "$CDI_HOLDER_SLEEP" | k apply -f -; }

cdi_holder_restarted() {
	[[ $(pod_field cdi-holder '{.status.containerStatuses[0].restartCount}') -ge 1 ]] &&
		[[ $(pod_field cdi-holder '{.status.containerStatuses[0].state.running.startedAt}') != "" ]]
}

case_cdi_spec_outlives_the_plugin() {
	local -a cdi=(--set cdi.enabled=true --set-string config.allocate.env.FI_PROVIDER=efa)
	local pid listing
	uninstall_plugin || return 1
	helm install efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" "${cdi[@]}" >/dev/null ||
		{ REASON="helm install with cdi.enabled failed"; return 1; }
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" "${cdi[@]}" >"$T/helm-cdi.yaml"
	plugin_installed_ok "$T/helm-cdi.yaml" || return 1
	cdi_holder >/dev/null || { REASON="holder pod not accepted"; return 1; }
	wait_until 60 pod_phase_is cdi-holder Running || { REASON="holder not Running within 60s"; return 1; }
	check_devices cdi-holder 1 || return 1
	listing=$(listing_entries <"$POD_LOG")

	helm uninstall efa -n "$NS" --wait >/dev/null || { REASON="helm uninstall failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still there 60s after helm uninstall"; return 1; }
	if [[ ! -s $CDI_SPEC ]]; then
		REASON="the plugin removed $CDI_SPEC although cdi-holder holds an EFA"
		return 1
	fi
	pid=$(pgrep -f "^sleep $CDI_HOLDER_SLEEP\$" | head -1)
	[[ -n $pid ]] || { REASON="holder's process not found on the host"; return 1; }
	kill -9 "$pid"
	if ! wait_until 60 cdi_holder_restarted; then
		REASON="holder's container not running again within 60s: $(pod_field cdi-holder '{.status.containerStatuses[0].state}')"
		return 1
	fi
	k logs cdi-holder >"$T/logs/pod-cdi-holder-restarted.log"
	if [[ $(listing_entries <"$T/logs/pod-cdi-holder-restarted.log") != "$listing" ]]; then
		REASON="the restarted container sees [$(listing_entries <"$T/logs/pod-cdi-holder-restarted.log" | paste -sd';')], want [$(paste -sd';' <<<"$listing")]"
		return 1
	fi
	CASE_DETAIL="spec kept with the plugin gone; the restarted container has its EFA"
	k delete pod cdi-holder --wait >/dev/null
	# Nobody is left to remove it: the plugin is gone.
	rm -f "$CDI_SPEC"
}
