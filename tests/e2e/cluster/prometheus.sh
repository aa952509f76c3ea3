# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# A real Prometheus against the installed plugin: built from source (see
# prometheus_binaries in lib/build.sh), run on the host on loopback with a
# kubeconfig and RBAC of its own that allow listing pods, discovering the
# plugin pod through Kubernetes pod discovery and the shipped prometheus.io/*
# annotations, and evaluating the chart's alert rules. What it is asked comes
# from the files users get: the README's metrics table and PromQL examples,
# and the dashboard's panels.
#
# Sourced by cluster.sh, which calls prometheus_build in its setup and runs
# the cases below. Each starts Prometheus through ensure_prometheus if it is
# not running yet, against the plugin of ensure_plugin (lib/cluster.sh), and
# those that ask about a holder's series through ensure_holder first.

PROMETHEUS_PORT=19090
PROMETHEUS_URL=http://127.0.0.1:$PROMETHEUS_PORT
PROMETHEUS_JOB=kubernetes-pods
# The EFA whose node the alert case takes away, by uverbs index.
ALERT_EFA=3

prom() { python3 "$HERE/lib/prometheus.py" "$@"; }

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
		prom rules "$d/rule.yaml" >"$d/rules.yaml" || return 1
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

# The counters of the EFA driver that the fake tree lacks, as a Nitro v4 EFA
# has them, each rising every second: traffic, drops, RDMA work-request
# errors, retransmissions, remote events.
PORT_COUNTERS=(tx_bytes rx_bytes rx_drops rdma_read_bytes rdma_read_wr_err rdma_write_wr_err
	retrans_pkts retrans_timeout_events unresponsive_remote_events impaired_remote_conn_events)
DEVICE_COUNTERS=(submitted_cmds cmds_err)
counter_dir() { printf '%s\n' "$FIXTURES/sys/class/infiniband/$(efa_ibdev "$1")"; }
ibdev_of() { printf 'rdmap%ss27\n' "$((16#${EFA_BUSES[$1]}))"; }

raise_counters() {
	local n=1 i dir c
	while :; do
		for i in "${!EFA_BUSES[@]}"; do
			dir=$(counter_dir "$i")
			mkdir -p "$dir/hw_counters"
			for c in "${PORT_COUNTERS[@]}"; do echo $((n * 1000000 + i)) >"$dir/ports/1/hw_counters/$c"; done
			for c in "${DEVICE_COUNTERS[@]}"; do echo "$n" >"$dir/hw_counters/$c"; done
		done
		n=$((n + 1))
		sleep 1
	done
}

target_up() {
	local pod ip
	pod=$(ready_plugin_pod) && ip=$(pod_field "$pod" '{.status.podIP}' "$NS") &&
		prom targets "$PROMETHEUS_URL" "$PROMETHEUS_JOB" 2>/dev/null | grep -q "^up http://$ip:9465/metrics "
}

# ensure_prometheus: Prometheus running, with the plugin pod a healthy target
# and the counters rising; started (the plugin restarted once, to read the
# counters) if it was not.
ensure_prometheus() {
	if [[ -z ${PIDS[prometheus]:-} ]]; then
		ensure_plugin || return 1
		prometheus_identity || { REASON="cannot give Prometheus its certificate and RBAC"; return 1; }
		prometheus_config || { REASON="Prometheus config or rules invalid: $(tail -3 "$T/logs/promtool-config.log" | paste -sd'|')"; return 1; }
		[[ -n ${PIDS[counters]:-} ]] || start_daemon counters raise_counters
		# The plugin opens a device's counter files once, as the driver's set is
		# fixed while it is loaded: a new pod reads the whole set.
		if ! wait_until 10 test -f "$(counter_dir 0)/hw_counters/cmds_err" ||
			! kns rollout restart "daemonset/$DS" >/dev/null ||
			! kns rollout status "daemonset/$DS" --timeout=120s >/dev/null ||
			! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is 4; then
			REASON="the plugin did not come back with 4 EFAs after its restart"
			return 1
		fi
		start_daemon prometheus "$PROMETHEUS_BIN/prometheus" --config.file "$T/prometheus/prometheus.yml" \
			--storage.tsdb.path "$T/prometheus/data" --web.listen-address "127.0.0.1:$PROMETHEUS_PORT"
	fi
	if ! wait_until 60 target_up; then
		REASON="no healthy $PROMETHEUS_JOB target for the plugin pod within 60s: $(prom targets "$PROMETHEUS_URL" "$PROMETHEUS_JOB" 2>&1 | paste -sd'|'); $(tail -2 "$T/logs/prometheus.log" | paste -sd'|')"
		return 1
	fi
}

case_prometheus_target() {
	ensure_prometheus || return 1
	CASE_DETAIL="$(prom targets "$PROMETHEUS_URL" "$PROMETHEUS_JOB" | cut -d' ' -f1,2)"
}

# has_series NAME: the family has series; a histogram's are its buckets.
has_series() {
	prom query "$PROMETHEUS_URL" "count({__name__=~\"$1(_bucket)?\", job=\"$PROMETHEUS_JOB\"})" >/dev/null 2>&1
}

# An unreadable numa_node is a scan error; the family appears with the first.
case_prometheus_families() {
	local numa name missing=() skipped=()
	# efa_device_allocation needs a holder.
	ensure_holder && ensure_prometheus || return 1
	numa=$(counter_dir 0)/device/numa_node
	mv "$numa" "$numa.saved" && mkfifo "$numa"
	wait_until 30 has_series efa_device_plugin_scan_errors_total
	rm -f "$numa" && mv "$numa.saved" "$numa"
	while read -r name; do
		if grep -F "\`$name\`" "$REPO/README.md" | grep -q 'cdi mode only'; then
			skipped+=("$name")
		elif ! wait_until 10 has_series "$name"; then
			missing+=("$name")
		fi
	done < <(prom families "$REPO/README.md")
	if ((${#missing[@]})); then
		REASON="families the README lists but Prometheus lacks: ${missing[*]}"
		return 1
	fi
	CASE_DETAIL="all present"
	((${#skipped[@]} == 0)) || CASE_DETAIL+="; not in device-specs mode, as the README says: ${skipped[*]}"
}

case_prometheus_holder_labels() {
	# holder_series sets these, in this scope.
	local out='' want got=''
	ensure_holder && ensure_prometheus || return 1
	want=$(printf '%s\n' "${HOLDER_IDS[@]}" | sort | paste -sd' ')
	# A holder created just now shows from the scrape after the plugin's next rescan.
	if ! wait_until 30 holder_series_are "$want"; then
		REASON="series with the holder's namespace, pod and container name devices [$got], want its [$want]"
		return 1
	fi
	CASE_DETAIL="$(awk '{s += $NF} END {print s}' <<<"$out") series name holder's $want"
}

# holder_series_are IDS: the devices of the series naming the holder, into got
# (and the answer into out), are IDS.
holder_series_are() {
	out=$(prom query "$PROMETHEUS_URL" \
		"count by (device) ({job=\"$PROMETHEUS_JOB\", namespace=\"default\", pod=\"holder\", container=\"probe\", device!=\"\"})")
	got=$(sed -n 's/.*"device": "\([^"]*\)".*/\1/p' <<<"$out" | sort | paste -sd' ')
	[[ $got == "$1" ]]
}

alert_is() { [[ $(prom alert "$PROMETHEUS_URL" EfaDeviceUnhealthy "ibdev=$1" 2>/dev/null) == "$2" ]]; }

# every_query_has_data WHAT COMMAND...: each query COMMAND prints, one a line
# as "label<TAB>query" or the query alone, returns at least one sample.
every_query_has_data() {
	local what=$1 label expr empty=()
	shift
	while IFS=$'\t' read -r label expr; do
		prom query "$PROMETHEUS_URL" "${expr:-$label}" >/dev/null 2>&1 || empty+=("$label${expr:+: $expr}")
	done < <("$@")
	((${#empty[@]} == 0)) && return 0
	REASON="$what without data: $(printf '%s|' "${empty[@]}")"
	return 1
}

# During the loss, every dashboard query returns data: all of them, including
# the unhealthy-device one, have something to show then.
dashboard_has_data() {
	every_query_has_data "dashboard queries" prom panels "$REPO/manifests/helm/efa-device-plugin/dashboards/efa-device-plugin.json"
}

case_prometheus_alert_lifecycle() {
	local ibdev start fired
	ensure_prometheus || return 1
	ibdev=$(ibdev_of "$ALERT_EFA")
	# A fresh allocation for the allocation and latency panels.
	run_job prometheus-job 1 || return 1
	rm "/dev/infiniband/uverbs$ALERT_EFA"
	start=$SECONDS
	if ! wait_until 90 alert_is "$ibdev" firing; then
		make_uverbs_node /dev "$ALERT_EFA"
		REASON="EfaDeviceUnhealthy for $ibdev is '$(prom alert "$PROMETHEUS_URL" EfaDeviceUnhealthy "ibdev=$ibdev")' 90s after its node went"
		return 1
	fi
	fired=$((SECONDS - start))
	if ! wait_until 30 dashboard_has_data; then
		make_uverbs_node /dev "$ALERT_EFA"
		return 1
	fi
	make_uverbs_node /dev "$ALERT_EFA"
	start=$SECONDS
	if ! wait_until 60 alert_is "$ibdev" inactive; then
		REASON="EfaDeviceUnhealthy for $ibdev still '$(prom alert "$PROMETHEUS_URL" EfaDeviceUnhealthy "ibdev=$ibdev")' 60s after its node returned"
		return 1
	fi
	CASE_DETAIL="firing after ${fired}s (for: 10s), every dashboard query had data, resolved $((SECONDS - start))s after the node returned"
	wait_until $((NODE_STATUS_PERIOD + 10)) allocatable_is 4 ||
		{ REASON="allocatable is '$(allocatable)' after the node returned, want 4"; return 1; }
}

# What the examples ask about is made true for the run: a DRA driver's
# registration socket withholds every EFA (conflict, all unhealthy), and the
# counters keep rising (traffic, retransmission timeouts).
DRA_SOCKET=/var/lib/kubelet/plugins_registry/dra.net-reg.sock

examples_have_results() { every_query_has_data "README examples" prom examples "$REPO/README.md"; }

case_readme_promql() {
	local n ok=0
	# Examples join on efa_device_allocation, which needs a holder.
	ensure_holder && ensure_prometheus || return 1
	n=$(prom examples "$REPO/README.md" | wc -l)
	python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' "$DRA_SOCKET" ||
		{ REASON="cannot create $DRA_SOCKET"; return 1; }
	wait_until 60 examples_have_results && ok=1
	rm -f "$DRA_SOCKET"
	((ok)) || return 1
	wait_until $((NODE_STATUS_PERIOD + 10)) allocatable_is 4 ||
		{ REASON="allocatable is '$(allocatable)' after the DRA socket went, want 4"; return 1; }
	CASE_DETAIL="all $n examples returned results"
}

# The alerts on the counters AWS names, which the counters the suite raises
# set off: each fires on one of the holder's EFAs naming the holder, and on an
# EFA no pod holds naming none.
COUNTER_ALERTS=(EfaReceiveDrops EfaRdmaReadErrors EfaRdmaWriteErrors)

# counter_alert_fires ALERT DEVICE HOLDER: ALERT is firing for DEVICE with the
# holder label HOLDER ("" matches an alert without one).
counter_alert_fires() {
	prom query "$PROMETHEUS_URL" "ALERTS{alertname=\"$1\", alertstate=\"firing\", device=\"$2\", holder=\"$3\"}" >/dev/null 2>&1
}

# An EFA with counters and no holder, as Prometheus sees it.
free_device() {
	prom query "$PROMETHEUS_URL" "count by (device) (efa_rx_drops_total unless on (instance, device) efa_device_allocation)" 2>/dev/null |
		sed -n 's/.*"device": "\([^"]*\)".*/\1/p' | head -1
}

case_prometheus_counter_alerts() {
	local alert held free fired=()
	ensure_holder && ensure_prometheus || return 1
	held=${HOLDER_IDS[0]}
	wait_until 30 test -n "$(free_device)" || { REASON="no EFA without a holder in Prometheus"; return 1; }
	free=$(free_device)
	for alert in "${COUNTER_ALERTS[@]}"; do
		if ! wait_until 90 counter_alert_fires "$alert" "$held" default/holder; then
			REASON="$alert not firing for the holder's $held with holder=default/holder within 90s: $(prom query "$PROMETHEUS_URL" "ALERTS{alertname=\"$alert\"}" 2>&1 | paste -sd'|')"
			return 1
		fi
		if ! wait_until 30 counter_alert_fires "$alert" "$free" ""; then
			REASON="$alert not firing for the free $free without a holder: $(prom query "$PROMETHEUS_URL" "ALERTS{alertname=\"$alert\"}" 2>&1 | paste -sd'|')"
			return 1
		fi
		fired+=("$alert")
	done
	CASE_DETAIL="${fired[*]} fired on $held (holder default/holder) and on $free (no holder)"
}
