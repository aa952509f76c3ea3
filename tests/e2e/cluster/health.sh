# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# What the plugin reports about the EFAs a running pod holds, and how that
# survives change: metrics naming the holder, a rolling update of the
# DaemonSet that keeps the holder's devices, and a device node that goes and
# comes back. Sourced by cluster.sh; each case runs against the holder of
# ensure_holder (lib/cluster.sh).

# holder_metrics POD: one scrape of POD into METRICS; true once it shows 4 healthy EFAs and, for
# each of the holder's EFAs, its counters and the info series naming the holder (HELD counts
# them).
holder_metrics() {
	local id ibdev
	HELD=0
	METRICS=$(scrape "$1") || return 1
	grep -qx 'efa_device_plugin_devices{health="healthy"} 4' <<<"$METRICS" || return 1
	for id in "${HOLDER_IDS[@]}"; do
		# An ID is the ibdev name, or with --device-id-strategy=pci the PCI address.
		ibdev=$id
		[[ $id == *:* ]] && ibdev=rdmap$((16#$(cut -d: -f2 <<<"$id")))s27
		if grep -E "^efa_[a-z_]+_total\{" <<<"$METRICS" | grep "device=\"$id\"" | grep -q "ibdev=\"$ibdev\"" &&
			grep -qxF "efa_device_allocation{device=\"$id\",namespace=\"default\",pod=\"holder\",container=\"probe\"} 1" <<<"$METRICS"; then
			HELD=$((HELD + 1))
		fi
	done
	((HELD == 2)) && (($(grep '^efa_device_allocation{' <<<"$METRICS" | grep -c 'pod="holder"') == 2))
}

case_metrics() {
	# holder_metrics sets these, in this scope.
	local pod METRICS='' HELD=0
	ensure_holder || return 1
	pod=$(ready_plugin_pod)
	# The plugin learns holders from the kubelet once per rescan interval (5 s), so a scrape
	# right after the pod starts may still show the pods before it.
	if ! wait_until 15 holder_metrics "$pod"; then
		if [[ -z $METRICS ]]; then
			REASON="no answer from http://$(pod_field "$pod" '{.status.podIP}' "$NS"):9465/metrics"
		elif ! grep -qx 'efa_device_plugin_devices{health="healthy"} 4' <<<"$METRICS"; then
			REASON="metrics lack efa_device_plugin_devices{health=\"healthy\"} 4: $(grep '^efa_device_plugin_devices' <<<"$METRICS" | paste -sd'|')"
		else
			REASON="after 15s $HELD of the holder's 2 EFAs have counters and an efa_device_allocation naming its namespace, pod and container: $(grep -E '^efa_device_allocation\{' <<<"$METRICS" | head -3 | paste -sd'|')"
		fi
		return 1
	fi
}

now_ms() { date +%s%3N; }

case_rolling_update() {
	local old new n low=4 below_since=0 below_ms=0 deadline
	ensure_holder || return 1
	old=$(ready_plugin_pod)
	kns rollout restart "daemonset/$DS" >/dev/null || { REASON="rollout restart rejected"; return 1; }
	deadline=$(($(now_ms) + 180000))
	# Sample allocatable until a new pod is Ready and 4 are back, adding up
	# the time the node showed fewer.
	while :; do
		n=$(allocatable)
		if [[ $n != 4 ]]; then
			((below_since == 0)) && below_since=$(now_ms)
			[[ $n =~ ^[0-9]+$ ]] && ((n < low)) && low=$n
		elif ((below_since != 0)); then
			below_ms=$((below_ms + $(now_ms) - below_since))
			below_since=0
		fi
		new=$(ready_plugin_pod)
		[[ -n $new && $new != "$old" && $n == 4 ]] && break
		if (($(now_ms) > deadline)); then
			REASON="rollout did not finish within 180s: ready pod '$new' (old $old), allocatable '$n'"
			return 1
		fi
		sleep 0.2
	done
	if ! pod_phase_is holder Running; then
		REASON="holder is $(pod_field holder '{.status.phase}') after the rollout"
		return 1
	fi
	if [[ $(allocated_ids "$(pod_field holder '{.metadata.uid}')") != "${HOLDER_IDS[*]}" ]]; then
		REASON="holder's devices changed across the rollout"
		return 1
	fi
	if ((below_ms > 0)); then
		CASE_DETAIL="node showed fewer than 4 allocatable for $((below_ms / 1000)).$(printf '%03d' $((below_ms % 1000)))s, lowest $low"
	else
		CASE_DETAIL="node never showed fewer than 4 allocatable"
	fi
}

case_device_loss() {
	local gone i start status
	ensure_holder || return 1
	gone=${HOLDER_IDS[0]}
	i=$(efa_index "$gone")
	rm "/dev/infiniband/uverbs$i"
	start=$SECONDS
	if ! wait_until $((NODE_STATUS_PERIOD + 2)) allocatable_is 3; then
		make_uverbs_node /dev "$i"
		REASON="allocatable is '$(allocatable)' $((SECONDS - start))s after uverbs$i went, want 3 within $((NODE_STATUS_PERIOD + 2))s"
		return 1
	fi
	CASE_DETAIL="3 after $((SECONDS - start))s"
	status=unavailable
	if health_gate_on; then
		if wait_until 30 holder_device_health "$gone" Unhealthy; then
			status="holder's $gone Unhealthy in allocatedResourcesStatus"
		else
			make_uverbs_node /dev "$i"
			REASON="holder's allocatedResourcesStatus does not show $gone Unhealthy: $(pod_field holder '{.status.containerStatuses[0].allocatedResourcesStatus}')"
			return 1
		fi
	fi
	make_uverbs_node /dev "$i"
	if ! wait_until $((NODE_STATUS_PERIOD + 2)) allocatable_is 4; then
		REASON="allocatable is '$(allocatable)' after uverbs$i came back, want 4"
		return 1
	fi
	if [[ $status == unavailable ]]; then
		status="pod-status health not shown: ResourceHealthStatus is not available in $KUBE_VERSION"
	elif ! wait_until 30 holder_device_health "$gone" Healthy; then
		REASON="holder's $gone not Healthy again: $(pod_field holder '{.status.containerStatuses[0].allocatedResourcesStatus}')"
		return 1
	fi
	CASE_DETAIL+="; $status"
}

# Whether this Kubernetes version has the gate at all.
health_gate_on() { grep -q 'ResourceHealthStatus=' <("$BIN/kubelet" --help 2>&1); }

holder_device_health() {
	pod_field holder '{range .status.containerStatuses[0].allocatedResourcesStatus[*].resources[*]}{.resourceID}={.health}{"\n"}{end}' |
		grep -qx "$1=$2"
}
