# shellcheck shell=bash
# shellcheck disable=SC2034 # PROMETHEUS_URL is read by host_request (cluster.sh)
# A real Prometheus against the installed plugin: built from source (see
# prometheus_binaries in lib/build.sh), run on the host on loopback with a
# kubeconfig and RBAC of its own that allow listing pods, discovering the
# plugin pod through Kubernetes pod discovery and the shipped prometheus.io/*
# annotations, and evaluating the chart's alert rules.
#
# Sourced by cluster.sh, which calls prometheus_build in its setup. The cases
# that ask it are the runner's (P1-P6 in runner/src/cluster/scrapes.rs, and
# the fleet's); the runner installs the plugin first and starts Prometheus
# through the host request `prometheus` (ensure_prometheus).

PROMETHEUS_PORT=19090
PROMETHEUS_URL=http://127.0.0.1:$PROMETHEUS_PORT
PROMETHEUS_JOB=kubernetes-pods

# prometheus_build: the binaries, before the cluster starts, and the port.
prometheus_build() {
	[[ -z $(ss -Hltn "sport = :$PROMETHEUS_PORT") ]] || fail_setup "port $PROMETHEUS_PORT is in use"
	PROMETHEUS_BIN=$(prometheus_binaries "$CACHE") ||
		fail_setup "Prometheus $PROMETHEUS_VERSION build failed"
	note "Prometheus $("$PROMETHEUS_BIN/prometheus" --version 2>&1 | head -1) (module $PROMETHEUS_VERSION)"
}

# Its own identity: a client certificate for user efa-e2e-prometheus, which
# RBAC allows to list and watch pods and nodes (the node-mode job) and nothing
# else.
prometheus_identity() {
	local p=$T/pki
	openssl req -newkey rsa:2048 -nodes -subj /CN=efa-e2e-prometheus -keyout "$p/prometheus.key" \
		-out "$p/prometheus.csr" 2>/dev/null &&
		openssl x509 -req -in "$p/prometheus.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
			-days 2 -out "$p/prometheus.crt" 2>/dev/null &&
		write_kubeconfig prometheus || return 1
	k apply -f - >/dev/null <<-EOF
		apiVersion: rbac.authorization.k8s.io/v1
		kind: ClusterRole
		metadata: {name: efa-e2e-prometheus}
		rules:
		- {apiGroups: [""], resources: [pods, nodes], verbs: [list, watch]}
		---
		apiVersion: rbac.authorization.k8s.io/v1
		kind: ClusterRoleBinding
		metadata: {name: efa-e2e-prometheus}
		roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: efa-e2e-prometheus}
		subjects:
		- {apiGroup: rbac.authorization.k8s.io, kind: User, name: efa-e2e-prometheus}
	EOF
}

# The scrape job is the prometheus-community chart's kubernetes-pods job, the
# usual reading of the prometheus.io/* annotations, unchanged. The rules are
# the chart's PrometheusRule with `for` and the window shortened through its
# values, so an alert can fire within the case.
prometheus_config() {
	local d=$T/prometheus
	mkdir -p "$d/data"
	helm template efa "$REPO/manifests/helm/efa-device-plugin" -n "$NS" --set prometheusRule.enabled=true \
		--set prometheusRule.for=10s --set prometheusRule.window=1m \
		--show-only templates/prometheusrule.yaml >"$d/rule.yaml" &&
		rule_groups <"$d/rule.yaml" >"$d/rules.yaml" || return 1
	cat >"$d/prometheus.yml" <<-EOF
		global: {scrape_interval: 2s, evaluation_interval: 2s}
		rule_files: [$d/rules.yaml]
		scrape_configs:
		  - job_name: $PROMETHEUS_JOB
		    honor_labels: true
		    kubernetes_sd_configs:
		      - {role: pod, kubeconfig_file: $T/pki/prometheus.kubeconfig}
		    relabel_configs:
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape], action: keep, regex: "true"}
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape_slow], action: drop, regex: "true"}
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scheme], action: replace, regex: '(https?)', target_label: __scheme__}
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path], action: replace, target_label: __metrics_path__, regex: '(.+)'}
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_port, __meta_kubernetes_pod_ip], action: replace, regex: '(\d+);(([A-Fa-f0-9]{1,4}::?){1,7}[A-Fa-f0-9]{1,4})', replacement: '[\$2]:\$1', target_label: __address__}
		      - {source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_port, __meta_kubernetes_pod_ip], action: replace, regex: '(\d+);((([0-9]+?)(\.|$)){4})', replacement: '\$2:\$1', target_label: __address__}
		      - {action: labelmap, regex: '__meta_kubernetes_pod_annotation_prometheus_io_param_(.+)', replacement: __param_\$1}
		      - {action: labelmap, regex: '__meta_kubernetes_pod_label_(.+)'}
		      - {source_labels: [__meta_kubernetes_namespace], action: replace, target_label: namespace}
		      - {source_labels: [__meta_kubernetes_pod_name], action: replace, target_label: pod}
		      - {source_labels: [__meta_kubernetes_pod_phase], regex: 'Pending|Succeeded|Failed|Completed', action: drop}
		      - {source_labels: [__meta_kubernetes_pod_node_name], action: replace, target_label: node}
	EOF
	# Node mode's job as docs/node-mode.md gives it, with the kubeconfig a
	# Prometheus outside the cluster needs for its node discovery.
	node_mode_job | sed -e "s|- role: node|- {role: node, kubeconfig_file: $T/pki/prometheus.kubeconfig}|" \
		-e 's/^/  /' >>"$d/prometheus.yml"
	"$PROMETHEUS_BIN/promtool" check config "$d/prometheus.yml" >"$T/logs/promtool-config.log" 2>&1
}

# node_mode_job: the scrape job of docs/node-mode.md's "Scraping the metrics".
node_mode_job() {
	awk '/^## Scraping the metrics/ { section = 1 } section && /^```yaml/ { job = 1; next }
		job && /^```/ { exit } job' "$REPO/docs/node-mode.md"
}

# rule_groups: the spec of the PrometheusRule on stdin, which is a Prometheus
# rules file (its groups), dedented out of the object.
rule_groups() {
	awk '/^spec:/ { spec = 1; next } spec && /^[^ ]/ { exit } spec { sub(/^  /, ""); print }'
}

# ensure_prometheus: Prometheus running, started if it was not; prints why on
# failure.
ensure_prometheus() {
	[[ -n ${PIDS[prometheus]:-} ]] && return 0
	prometheus_identity || { echo "cannot give Prometheus its certificate and RBAC"; return 1; }
	prometheus_config || { echo "Prometheus config or rules invalid: $(tail -3 "$T/logs/promtool-config.log" | paste -sd'|')"; return 1; }
	start_daemon prometheus "$PROMETHEUS_BIN/prometheus" --config.file "$T/prometheus/prometheus.yml" \
		--storage.tsdb.path "$T/prometheus/data" --web.listen-address "127.0.0.1:$PROMETHEUS_PORT"
}
