# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# Installing the plugin as users do: the kustomize overlay of the shipped
# manifests, the same on a node without EFA, the Helm chart from install to
# uninstall, and the chart in cdi mode. Sourced by cluster.sh; the helpers
# and fixtures are lib/cluster.sh's.

case_kustomize_install() {
	uninstall_plugin || return 1
	kustomize_install p4d
}
# A kustomize install is replaced in place; a release of the chart would
# fight the overlay over its objects.
case_no_efa() {
	uninstall_releases
	k apply -k "$HERE/cluster/kustomize/no-efa" >/dev/null || { REASON="kubectl apply -k rejected the no-efa overlay"; return 1; }
	if ! wait_until 120 plugin_on_tree "$FIXTURES/no-efa"; then
		REASON="no Ready plugin pod on the empty tree within 120s: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|')"
		return 1
	fi
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is_none; then
		REASON="allocatable $RESOURCE is '$(allocatable)' on a node without EFA, want 0 or absent"
		return 1
	fi
	CASE_DETAIL="allocatable '$(allocatable)'"
}

allocatable_is_none() { [[ $(allocatable) == "" || $(allocatable) == 0 ]]; }

# plugin_on_tree DIR: the Ready plugin pod mounts DIR as its sysfs.
plugin_on_tree() {
	local pod
	pod=$(ready_plugin_pod) && [[ -n $pod ]] &&
		[[ $(pod_field "$pod" '{.spec.volumes[?(@.name=="e2e-sysfs")].hostPath.path}' "$NS") == "$1" ]]
}

case_helm() {
	local rendered old new
	uninstall_plugin || return 1
	# The API server must accept every object the chart renders, with the
	# defaults and with every switch on (the PodMonitor and PrometheusRule
	# need their CRDs).
	if ! k apply --server-side "${OPERATOR_CRDS[@]/#/-f}" >/dev/null ||
		! k wait --for condition=Established crd/podmonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com --timeout=60s >/dev/null; then
		REASON="the PodMonitor and PrometheusRule CRDs were not established"
		return 1
	fi
	for values in "" "$REPO/tests/deploy/values-variant.yaml"; do
		if ! helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" ${values:+-f "$values"} >"$T/helm-render.yaml"; then
			REASON="helm template failed with ${values:-default values}"
			return 1
		fi
		if ! rendered=$(k apply --dry-run=server -f "$T/helm-render.yaml" 2>&1); then
			REASON="API server rejected the chart rendered with ${values:-default values}: $(tail -2 <<<"$rendered" | paste -sd'|')"
			return 1
		fi
	done
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" >"$T/helm-default.yaml"
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" >"$T/helm-e2e.yaml"
	if ! REASON=$(python3 "$HERE/lib/pod_spec.py" compare "$T/helm-default.yaml" "$T/helm-e2e.yaml" 2>&1); then
		return 1
	fi
	helm install efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" >/dev/null ||
		{ REASON="helm install failed"; return 1; }
	plugin_installed_ok "$T/helm-default.yaml" || return 1
	run_job helm-job 2 || return 1
	old=$(ready_plugin_pod)
	helm upgrade efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" \
		--set config.log-level=debug >/dev/null || { REASON="helm upgrade failed"; return 1; }
	if ! wait_until 120 rolled_from "$old"; then
		REASON="plugin pod did not roll after helm upgrade (still $old)"
		return 1
	fi
	helm uninstall efa -n "$NS" --wait >/dev/null || { REASON="helm uninstall failed"; return 1; }
	if ! wait_until 60 no_plugin_pod; then
		REASON="plugin pod still there 60s after helm uninstall"
		return 1
	fi
	if [[ -e $DP_DIR/efa-device-plugin.sock ]]; then
		REASON="$DP_DIR/efa-device-plugin.sock remains after helm uninstall"
		return 1
	fi
}

rolled_from() { local p; p=$(ready_plugin_pod) && [[ -n $p && $p != "$1" ]] && allocatable_is 4; }

# The spec file the plugin writes in cdi mode, where containerd 2 reads it.
CDI_SPEC=/var/run/cdi/vpc.amazonaws.com-efa.json

case_cdi() {
	local pod env spec_ids want_ids
	local -a cdi=(--set cdi.enabled=true --set-string config.allocate.env.FI_PROVIDER=efa)
	uninstall_plugin || return 1
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" "${cdi[@]}" >"$T/helm-cdi.yaml"
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" "${cdi[@]}" >"$T/helm-cdi-e2e.yaml"
	if ! REASON=$(python3 "$HERE/lib/pod_spec.py" compare "$T/helm-cdi.yaml" "$T/helm-cdi-e2e.yaml" 2>&1); then
		return 1
	fi
	helm install efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$TEST_VALUES" "${cdi[@]}" >/dev/null ||
		{ REASON="helm install with cdi.enabled failed"; return 1; }
	plugin_installed_ok "$T/helm-cdi.yaml" || return 1
	if ! wait_until 10 test -s "$CDI_SPEC"; then
		REASON="no CDI spec at $CDI_SPEC"
		return 1
	fi
	spec_ids=$(python3 -c 'import json, sys; print(" ".join(sorted(d["name"] for d in json.load(open(sys.argv[1]))["devices"])))' "$CDI_SPEC")
	want_ids=$(efa_ibdevs)
	if [[ $spec_ids != "$want_ids" ]]; then
		REASON="CDI spec devices [$spec_ids], want [$want_ids]"
		return 1
	fi
	run_job cdi-job 2 || return 1
	env=$(grep '^FI_PROVIDER=' "$POD_LOG")
	if [[ $env != FI_PROVIDER=efa ]]; then
		REASON="the Job's container has ${env:-no FI_PROVIDER line}, want FI_PROVIDER=efa"
		return 1
	fi
	# The spec goes with the plugin only once the kubelet lists no container holding an EFA:
	# the health cases' holder may still hold two.
	k delete pods --all -n default --wait >/dev/null
	helm uninstall efa -n "$NS" --wait >/dev/null || { REASON="helm uninstall failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still there 60s after helm uninstall"; return 1; }
	if [[ -e $CDI_SPEC ]]; then
		REASON="$CDI_SPEC remains after the plugin stopped with no holder left"
		return 1
	fi
}
