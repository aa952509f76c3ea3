# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# Handing a node from this plugin to a DRA driver and back with pod specs
# unchanged (KEP-5004, DRAExtendedResource): the DeviceClass
# efa.networking.k8s.aws maps vpc.amazonaws.com/efa to DRA, and the plugin's
# DRA guard (allocatable 0 while dra.net is registered) lets the scheduler
# delegate the resource on that node. The DRA driver is tests/e2e/dra-standin,
# registered as DRANET is. Sourced by cluster.sh; the helpers are
# lib/cluster.sh's.
#
# Each case starts from a node with no plugin, no DRA driver, no DeviceClass,
# no pod in the default namespace and the node schedulable, and leaves it so.

DRA_IMAGE=localhost/dra-standin:e2e
DRA_SOCKET=/var/lib/kubelet/plugins_registry/dra.net-reg.sock
DRA_STANDIN=
# The first pod (through the plugin), the pods after it, and a second DRA pod.
P1=dra-p1
P2=dra-p2
P3=dra-p3

# ---------------------------------------------------------------- helpers

# Whether the scheduler may hand vpc.amazonaws.com/efa to DRA in this
# version: DRAExtendedResource on by default (beta in 1.36), or GA (1.37),
# when --help no longer lists it.
dra_bridge_on() {
	local gate
	gate=$("$BIN/kube-scheduler" --help 2>&1 | grep -o 'DRAExtendedResource=[^)]*)')
	[[ $gate == *default=true* ]] || { [[ -z $gate ]] && (($(cut -d. -f2 <<<"$KUBE_VERSION") >= 37)); }
}

# dra_standin_image: the stand-in's FROM scratch image, built and imported
# once per run.
dra_standin_image() {
	local ctx=$T/dra-standin-context start=$SECONDS
	[[ -f $T/images/dra-standin.tar ]] && return 0
	if ! DRA_STANDIN=$(dra_driver "$CACHE" "$HERE/dra-standin" dra-standin "$HERE/efasysfs" 2>"$T/logs/dra-standin-build.log"); then
		REASON="building the DRA driver stand-in failed: $(tail -3 "$T/logs/dra-standin-build.log" | paste -sd'|')"
		return 1
	fi
	mkdir -p "$ctx" && cp "$DRA_STANDIN" "$ctx/dra-standin" || return 1
	if ! oci_archive "$T/buildah" "$DRA_IMAGE" "$T/images/dra-standin.tar.tmp" \
		-f "$HERE/dra-standin/Containerfile" "$ctx" >"$T/logs/buildah-dra-standin.log" 2>&1 ||
		! ctr_k8s images import "$T/images/dra-standin.tar.tmp" >>"$T/logs/buildah-dra-standin.log" 2>&1; then
		REASON="DRA stand-in image build or import failed: $(tail -3 "$T/logs/buildah-dra-standin.log" | paste -sd'|')"
		return 1
	fi
	mv "$T/images/dra-standin.tar.tmp" "$T/images/dra-standin.tar"
	note "DRA driver stand-in image ready in $((SECONDS - start))s"
}

dra_manifest() {
	sed -e "s#SYSFS_HOST_PATH#$FIXTURES/sys#" -e "s#\"APISERVER_PORT\"#\"$APISERVER_PORT\"#" "$HERE/dra-standin/daemonset.yaml"
}

dra_pod() { kns get pods -l name=dra-standin -o jsonpath='{.items[0].metadata.name}' 2>/dev/null; }

# The EFAs the stand-in publishes for the node, as "name pciAddress rdmaDevice pcieRoot numaNode" lines.
dra_slice_devices() {
	k get resourceslices -o json 2>/dev/null | python3 -c '
import json, sys
for s in json.load(sys.stdin)["items"]:
    spec = s["spec"]
    if spec.get("driver") != "dra.net" or spec.get("nodeName") != sys.argv[1]:
        continue
    for d in spec.get("devices", []):
        a = d.get("attributes", {})
        v = lambda k: str(next(iter(a.get(k, {"-": "-"}).values())))
        print(d["name"], v("dra.net/pciAddress"), v("dra.net/rdmaDevice"), v("resource.kubernetes.io/pcieRoot"), v("resource.kubernetes.io/numaNode"))' "$NODE" | sort
}

dra_published() { [[ $(dra_slice_devices | wc -l) == 4 ]]; }

# dra_install: the stand-in running, registered with the kubelet, publishing
# the node's 4 EFAs with DRANET's attributes.
dra_install() {
	local got want i
	dra_standin_image || return 1
	dra_manifest | k apply -f - >/dev/null || { REASON="the API server rejected the stand-in's manifest"; return 1; }
	if ! wait_until 60 dra_ready; then
		REASON="stand-in pod not Ready within 60s: $(kns get pods -l name=dra-standin -o wide 2>&1 | tail -n +2 | paste -sd'|'); $(kns logs "$(dra_pod)" 2>&1 | tail -2 | paste -sd'|')"
		return 1
	fi
	if ! wait_until 30 test -S "$DRA_SOCKET" || ! wait_until 30 dra_published; then
		REASON="stand-in not registered ($DRA_SOCKET) or no slice with 4 EFAs within 30s: $(kns logs "$(dra_pod)" 2>&1 | tail -2 | paste -sd'|')"
		return 1
	fi
	got=$(dra_slice_devices)
	want=$(for i in "${!EFA_BUSES[@]}"; do
		echo "$(efa_ibdev "$i") $(efa_pci "$i") $(efa_ibdev "$i") pci0000:${EFA_BUSES[$i]} ${EFA_NUMA[$i]}"
	done | sort)
	if [[ $got != "$want" ]]; then
		REASON="the ResourceSlice has [$(paste -sd'|' <<<"$got")], want [$(paste -sd'|' <<<"$want")]"
		return 1
	fi
}

dra_ready() {
	local p
	p=$(dra_pod) && [[ -n $p ]] &&
		[[ $(pod_field "$p" '{.status.conditions[?(@.type=="Ready")].status}' "$NS") == True ]]
}

dra_uninstall() {
	dra_manifest | k delete -f - --wait >/dev/null 2>&1
	if ! wait_until 60 dra_gone; then
		REASON="stand-in pod or $DRA_SOCKET still there 60s after its deletion"
		return 1
	fi
}

dra_gone() { [[ -z $(dra_pod) && ! -e $DRA_SOCKET ]]; }

deviceclass_apply() {
	k apply -f "$HERE/dra-standin/deviceclass.yaml" >/dev/null || { REASON="the API server rejected the DeviceClass"; return 1; }
}

# ours_labelled: this chart with nodeScope.mode=labelled on the labelled node,
# serving 4 EFAs.
ours_labelled() {
	k label node "$NODE" "$SCOPE_LABEL=true" --overwrite >/dev/null &&
		ours_install --set nodeScope.mode=labelled &&
		ours_rolled_out
}

capacity() { k get node "$NODE" -o jsonpath="{.status.capacity.${RESOURCE//./\\.}}" 2>/dev/null; }

# guard_tripped HELD: allocatable 0, capacity 4, the conflict gauge 1 and
# HELD EFAs counted as unseen by the driver.
guard_tripped() {
	local pod
	pod=$(ready_plugin_pod)
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is 0; then
		REASON="allocatable is '$(allocatable)' with dra.net registered, want 0"
		return 1
	fi
	if [[ $(capacity) != 4 ]]; then
		REASON="capacity is '$(capacity)' with dra.net registered, want 4"
		return 1
	fi
	if ! wait_until 20 metric_is "$pod" efa_device_plugin_dra_conflict 1 ||
		! wait_until 20 metric_is "$pod" efa_device_plugin_dra_conflict_held_devices "$1"; then
		REASON="efa_device_plugin_dra_conflict '$(metric "$pod" efa_device_plugin_dra_conflict)', _held_devices '$(metric "$pod" efa_device_plugin_dra_conflict_held_devices)', want 1 and $1"
		return 1
	fi
}

metric_is() { [[ $(metric "$1" "$2") == "$3" ]]; }

# The claim the scheduler made for a pod's extended resource, empty if none.
extended_claim() { pod_field "$1" '{.status.extendedResourceClaimStatus.resourceClaimName}'; }

# dra_pod_ok POD: the pod runs through DRA: its extendedResourceClaimStatus
# names a claim allocated by dra.net, and its container sees exactly that
# EFA's uverbs node. Sets CLAIM and CLAIM_DEVICE.
dra_pod_ok() {
	local pod=$1 got want
	if ! wait_until 60 pod_phase_is "$pod" Running; then
		REASON="pod $pod not Running within 60s: $(pod_field "$pod" '{.status.phase}') $(pod_events "$pod")"
		return 1
	fi
	CLAIM=$(extended_claim "$pod")
	if [[ -z $CLAIM ]]; then
		REASON="pod $pod has no status.extendedResourceClaimStatus; the checkpoint gives it [$(allocated_ids "$(pod_field "$pod" '{.metadata.uid}')")]"
		return 1
	fi
	CLAIM_DEVICE=$(k -n default get resourceclaim "$CLAIM" -o jsonpath='{range .status.allocation.devices.results[*]}{.driver}/{.device}{"\n"}{end}' 2>/dev/null)
	if [[ $CLAIM_DEVICE != dra.net/* || $(wc -l <<<"$CLAIM_DEVICE") != 1 ]]; then
		REASON="claim $CLAIM is allocated [$(paste -sd' ' <<<"$CLAIM_DEVICE")], want one dra.net device"
		return 1
	fi
	CLAIM_DEVICE=${CLAIM_DEVICE#dra.net/}
	wait_until 20 has_listing "$pod"
	got=$(k logs "$pod" | listing_entries)
	want=$(expected_entries "$CLAIM_DEVICE")
	if [[ $got != "$want" ]]; then
		REASON="pod $pod sees [$(paste -sd';' <<<"$got")] in /dev/infiniband, want [$want] of its claim's $CLAIM_DEVICE"
		return 1
	fi
}

# The CDI spec the stand-in wrote for a claim.
claim_spec() { echo "/var/run/cdi/dra.net-efa-$(k -n default get resourceclaim "$1" -o jsonpath='{.metadata.uid}').json"; }

dra_reset() {
	k uncordon "$NODE" >/dev/null 2>&1
	k -n default delete pods --all --wait --timeout=60s >/dev/null 2>&1
	dra_manifest | k delete -f - --ignore-not-found --wait >/dev/null 2>&1
	k delete -f "$HERE/dra-standin/deviceclass.yaml" --ignore-not-found >/dev/null 2>&1
	uninstall_plugin
	k label node "$NODE" "$SCOPE_LABEL-" >/dev/null 2>&1
	wait_until 60 dra_gone
}

# on_dra_node FN: FN between two resets; its status.
on_dra_node() {
	local rc
	dra_reset
	"$1"
	rc=$?
	dra_reset
	return "$rc"
}

# ---------------------------------------------------------------- cases

# The procedure of docs/dra.md: the plugin serves P1; cordon, drain, install the
# driver; the guard trips; uncordon; P2, the same spec, runs through DRA; the
# plugin leaves the node through its label; P2 keeps running.
dra_handoff() {
	local p1_ids spec
	deviceclass_apply && ours_labelled || return 1
	start_pod "$P1" 1 || return 1
	p1_ids=${POD_IDS[*]}
	[[ -z $(extended_claim "$P1") ]] || { REASON="$P1 went through DRA while the plugin served"; return 1; }
	k cordon "$NODE" >/dev/null || { REASON="cordon failed"; return 1; }
	k drain "$NODE" --ignore-daemonsets --force --timeout=60s >/dev/null 2>&1 || { REASON="drain failed"; return 1; }
	dra_install && guard_tripped 0 || return 1
	k uncordon "$NODE" >/dev/null || { REASON="uncordon failed"; return 1; }
	workload "$P2" pod 1 >/dev/null || { REASON="pod $P2 not accepted"; return 1; }
	dra_pod_ok "$P2" || return 1
	spec=$(claim_spec "$CLAIM")
	[[ -s $spec ]] || { REASON="no CDI spec $spec for $P2's claim"; return 1; }
	k label node "$NODE" "$SCOPE_LABEL-" >/dev/null || { REASON="removing the node label failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still on the node 60s after its label went"; return 1; }
	sleep "$NODE_STATUS_PERIOD"
	if ! pod_phase_is "$P2" Running || [[ $(k logs "$P2" | listing_entries) != "$(expected_entries "$CLAIM_DEVICE")" ]]; then
		REASON="$P2 is $(pod_field "$P2" '{.status.phase}') after the plugin left"
		return 1
	fi
	k delete pod "$P2" --wait >/dev/null || { REASON="cannot delete $P2"; return 1; }
	wait_until 30 test ! -e "$spec" || { REASON="$spec still there after $P2 went"; return 1; }
	CASE_DETAIL="P1 through the plugin [$p1_ids]; guard: allocatable 0, capacity 4, dra_conflict 1, held_devices 0; P2 through DRA, claim $CLAIM on $CLAIM_DEVICE, sees only its uverbs node; plugin gone: P2 Running, allocatable '$(allocatable)' capacity '$(capacity)'; unprepare removed the CDI spec"
}

# The driver arrives while P1 holds an EFA through the plugin. Records whom
# the scheduler then gives which EFA: DRA sees all 4 as free.
dra_unsafe() {
	local pod p1_id p1_node warned n_dev m_devs shared
	deviceclass_apply && ours_labelled || return 1
	start_pod "$P1" 1 || return 1
	p1_id=${POD_IDS[0]}
	p1_node=$(expected_entries "$p1_id")
	dra_install && guard_tripped 1 || return 1
	pod=$(ready_plugin_pod)
	sleep 12
	warned=$(kns logs "$pod" 2>/dev/null | grep -F 'while an EFA DRA driver is registered' | grep -F "\"pod\":\"$P1\"" | grep -cF "$p1_id")
	if ((warned != 1)); then
		REASON="$warned warnings naming $P1 and $p1_id in $pod's log, want 1"
		return 1
	fi
	workload "$P2" pod 1 >/dev/null || { REASON="pod $P2 not accepted"; return 1; }
	dra_pod_ok "$P2" || return 1
	n_dev=$CLAIM_DEVICE
	# With 3 more through DRA, all 4 EFAs are DRA's: one is P1's.
	workload "$P3" pod 3 >/dev/null || { REASON="pod $P3 not accepted"; return 1; }
	if ! wait_until 60 pod_phase_is "$P3" Running; then
		REASON="$P3 (3 EFAs) not Running: $(pod_events "$P3")"
		return 1
	fi
	m_devs=$(k -n default get resourceclaim "$(extended_claim "$P3")" -o jsonpath='{range .status.allocation.devices.results[*]}{.device}{" "}{end}')
	wait_until 20 has_listing "$P3"
	shared=$(comm -12 <(echo "$p1_node") <({ k logs "$P2"; k logs "$P3"; } | listing_entries))
	if [[ $shared != "$p1_node" ]]; then
		REASON="no DRA pod sees P1's $p1_node; P2 has $n_dev, P3 has $m_devs"
		return 1
	fi
	CASE_DETAIL="P1 holds $p1_id through the plugin; guard: allocatable 0, capacity 4, held_devices 1, $warned warning naming P1; the scheduler gave P2 (same spec) $n_dev ($([[ $n_dev == "$p1_id" ]] && echo "P1's EFA" || echo "not P1's")), P3 (3 EFAs) $m_devs: P1's EFA is in two pods"
}

# From a node DRA serves back to the plugin: drain the DRA pods, remove the
# driver; the guard clears and the same spec runs through the plugin.
dra_hand_back() {
	local spec
	deviceclass_apply && ours_labelled && dra_install && guard_tripped 0 || return 1
	workload "$P2" pod 1 >/dev/null || { REASON="pod $P2 not accepted"; return 1; }
	dra_pod_ok "$P2" || return 1
	spec=$(claim_spec "$CLAIM")
	if ! k cordon "$NODE" >/dev/null || ! k drain "$NODE" --ignore-daemonsets --force --timeout=60s >/dev/null 2>&1; then
		REASON="cordon or drain failed"
		return 1
	fi
	wait_until 30 test ! -e "$spec" || { REASON="$spec still there after $P2 was drained"; return 1; }
	dra_uninstall || return 1
	if ! wait_until $((NODE_STATUS_PERIOD + 30)) allocatable_is 4 ||
		! wait_until 20 metric_is "$(ready_plugin_pod)" efa_device_plugin_dra_conflict 0; then
		REASON="allocatable '$(allocatable)', dra_conflict '$(metric "$(ready_plugin_pod)" efa_device_plugin_dra_conflict)' after the driver left, want 4 and 0"
		return 1
	fi
	k uncordon "$NODE" >/dev/null || { REASON="uncordon failed"; return 1; }
	start_pod "$P3" 1 || return 1
	if [[ -n $(extended_claim "$P3") ]]; then
		REASON="$P3 went through DRA ($(extended_claim "$P3")) with the plugin serving again"
		return 1
	fi
	CASE_DETAIL="P2 through DRA on $CLAIM_DEVICE; drained, driver removed: dra_conflict 0, allocatable 4; P3 (same spec) through the plugin [${POD_IDS[*]}], no extendedResourceClaimStatus"
}

# Without the bridge the guard still withholds every EFA, and nothing serves
# the resource: the same pod stays Pending.
dra_no_bridge() {
	local mapped
	deviceclass_apply && ours_labelled && dra_install && guard_tripped 0 || return 1
	mapped=$(k get deviceclass efa.networking.k8s.aws -o jsonpath='{.spec.extendedResourceName}')
	workload "$P2" pod 1 >/dev/null || { REASON="pod $P2 not accepted"; return 1; }
	if ! wait_until 60 failed_scheduling "$P2"; then
		REASON="no FailedScheduling naming Insufficient $RESOURCE within 60s: $(pod_field "$P2" '{.status.phase}') $(pod_events "$P2")"
		return 1
	fi
	sleep 10
	if ! pod_phase_is "$P2" Pending || [[ -n $(extended_claim "$P2") ]]; then
		REASON="$P2 is $(pod_field "$P2" '{.status.phase}') with claim '$(extended_claim "$P2")', want Pending without one"
		return 1
	fi
	CASE_DETAIL="guard: allocatable 0, capacity 4; the DeviceClass's extendedResourceName reads back '${mapped:-(dropped: gate off)}'; the pod stays Pending: $(pod_events "$P2" | tail -c 160)"
}

# The hand-over with a kubelet restart in it (kubernetes PR #141426, fixed in
# 1.38): P1 holds an EFA through the plugin; docs/dra.md's hand-over (cordon,
# drain, driver in, plugin out by its label); the kubelet restarts, with the
# plugin's resource in its checkpoint; P2, the same spec, is given an EFA by
# DRA. Records whether P2's container starts. Before 1.38 the kubelet may
# still take the resource for the device plugin's and refuse or fail P2: the
# case passes either way there and says which; from 1.38 on P2 must run.
dra_restart_handoff() {
	local log mark outcome minor
	deviceclass_apply && ours_labelled || return 1
	start_pod "$P1" 1 || return 1
	k cordon "$NODE" >/dev/null || { REASON="cordon failed"; return 1; }
	k drain "$NODE" --ignore-daemonsets --force --timeout=60s >/dev/null 2>&1 || { REASON="drain failed"; return 1; }
	dra_install && guard_tripped 0 || return 1
	k label node "$NODE" "$SCOPE_LABEL-" >/dev/null || { REASON="removing the node label failed"; return 1; }
	wait_until 60 no_plugin_pod || { REASON="plugin pod still on the node 60s after its label went"; return 1; }
	log=$T/logs/kubelet-$NODE.log
	mark=$(wc -l <"$log")
	stop_daemon "kubelet-$NODE"
	start_node_kubelet "$NODE" || { REASON="$NODE not Ready after its kubelet restarted"; return 1; }
	if ! { wait_until 30 test -S "$DRA_SOCKET" && wait_until 30 dra_published; }; then
		REASON="the DRA stand-in did not register again after the kubelet restart"
		return 1
	fi
	k uncordon "$NODE" >/dev/null || { REASON="uncordon failed"; return 1; }
	workload "$P2" pod 1 >/dev/null || { REASON="pod $P2 not accepted"; return 1; }
	wait_until 60 p2_settled || { REASON="$P2 neither Running nor refused within 60s: $(pod_events "$P2")"; return 1; }
	if pod_phase_is "$P2" Running && dra_pod_ok "$P2"; then
		outcome="P2 Running through DRA on $CLAIM_DEVICE"
	else
		outcome="P2 $(pod_field "$P2" '{.status.phase}') $(pod_field "$P2" '{.status.reason}'): $(pod_field "$P2" '{.status.message}')$(pod_field "$P2" '{.status.containerStatuses[0].state.waiting.message}')"
		minor=$(cut -d. -f2 <<<"$KUBE_VERSION")
		if ((minor >= 38)); then
			REASON="$outcome; the kubelet's log: $(tail -n +"$((mark + 1))" "$log" | grep -m2 -F "$P2" | cut -c1-200 | paste -sd'|')"
			return 1
		fi
	fi
	CASE_DETAIL="kubelet $KUBE_VERSION restarted after the hand-over: $outcome"
}

# p2_settled: P2 Running, Failed, or its container stuck in a start error.
p2_settled() {
	pod_phase_is "$P2" Running || pod_phase_is "$P2" Failed ||
		[[ $(pod_field "$P2" '{.status.containerStatuses[0].state.waiting.reason}') == *Error* ]]
}

case_dra_handoff() { on_dra_node dra_handoff; }
case_dra_unsafe() { on_dra_node dra_unsafe; }
case_dra_hand_back() { on_dra_node dra_hand_back; }
case_dra_restart_handoff() { on_dra_node dra_restart_handoff; }
case_dra_no_bridge() { on_dra_node dra_no_bridge; }

# dra_cases: the cases this version can run, with the bridge or without it.
dra_cases() {
	if dra_bridge_on; then
		run_case "(D1) DRA handoff, documented order: cordon, drain, driver in; same spec through DRA; plugin leaves by label" case_dra_handoff
		run_case "(D2) DRA handoff unsafe: driver in while P1 holds an EFA; warning, held_devices, whom DRA gives P1's EFA" case_dra_unsafe
		run_case "(D3) DRA hand back: drain, driver out; guard clears, same spec through the plugin" case_dra_hand_back
		run_case "(D5) DRA handoff, then a kubelet restart: does the same spec's new pod start through DRA (PR #141426)" case_dra_restart_handoff
	else
		run_case "(D4) no DRAExtendedResource in $KUBE_VERSION: with the DRA driver present the same pod stays Pending" case_dra_no_bridge
	fi
}
