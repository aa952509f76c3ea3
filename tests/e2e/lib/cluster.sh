# shellcheck shell=bash
# kubectl and helm against the suite's cluster: the installs and uninstalls the
# runner asks for (cluster.sh's host_request). Sourced by cluster.sh, which
# sets BIN, KUBECONFIG, HELM, NS, DS, T and the fixture paths. An install or
# uninstall that fails prints why on stdout, which host_request replies with,
# and prints nothing there otherwise.

# This chart's release, as the README installs it; its DaemonSet is DS.
OURS_RELEASE=efa-device-plugin

k() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG" "$@"; }
kns() { k -n "$NS" "$@"; }
helm() { "$HELM" --kubeconfig "$KUBECONFIG" "$@"; }

no_plugin_pod() { [[ -z $(kns get pods -l app.kubernetes.io/name=efa-device-plugin -o name 2>/dev/null) ]]; }

# ---------------------------------------------------------------- installs

# ours_install HELM_ARG...: this chart as the README installs it, plus only the
# test values (the local image and the fake sysfs tree).
ours_install() {
	ours_helm install "$@" >/dev/null || { echo "helm install $OURS_RELEASE $* failed"; return 1; }
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
	echo "plugin pod still there 60s after its uninstall: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|')"
	return 1
}

# uninstall_releases: every release of this chart uninstalled, whatever its
# name: those whose chart column (NAME-VERSION) names this chart.
uninstall_releases() {
	local release
	for release in $(helm list -n "$NS" --no-headers 2>/dev/null |
		awk '{ for (i = 2; i <= NF; i++) if (index($i, "efa-device-plugin-") == 1) { print $1; break } }'); do
		helm uninstall "$release" -n "$NS" --wait >/dev/null 2>&1
	done
}
