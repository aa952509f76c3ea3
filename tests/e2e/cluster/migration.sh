# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# Migrating a node from the AWS plugin to this one, with a stand-in for the
# AWS plugin (tests/e2e/aws-standin: its socket, ibdev-name IDs, one rw
# DeviceSpec per uverbs node, no GetPreferredAllocation), installed as the AWS
# chart installs it. Sourced by cluster.sh; the helpers are lib/cluster.sh's.
#
# Each case starts from a node with neither plugin installed and no pod in
# the default namespace (it deletes what earlier cases left, the holder pod
# included) and leaves it so.

STANDIN_IMAGE=localhost/aws-efa-k8s-device-plugin:e2e
STANDIN=
SAMPLER=
LOOKUP=
H_NODES=
H_IDS=()
# The holder H and the new pod N.
H=mig-h
N=mig-n

# ---------------------------------------------------------------- helpers

# standin_binary: the stand-in, built once per run for the cluster's version.
standin_binary() {
	[[ -n $STANDIN ]] && return 0
	local start=$SECONDS
	if ! STANDIN=$(stub_plugin "$CACHE" "$HERE/aws-standin" aws-standin "$HERE/efasysfs" "$HERE/podreslist" 2>"$T/logs/aws-standin-build.log"); then
		STANDIN=
		REASON="building the AWS plugin stand-in failed: $(tail -3 "$T/logs/aws-standin-build.log" | paste -sd'|')"
		return 1
	fi
	note "AWS plugin stand-in ready in $((SECONDS - start))s"
}

# standin_image: its FROM scratch image, built and imported once per run.
standin_image() {
	local ctx=$T/standin-context
	[[ -f $T/images/aws-standin.tar ]] && return 0
	standin_binary || return 1
	mkdir -p "$ctx" && cp "$STANDIN" "$ctx/aws-standin" || return 1
	if ! oci_archive "$T/buildah" "$STANDIN_IMAGE" "$T/images/aws-standin.tar.tmp" \
		-f "$HERE/aws-standin/Containerfile" "$ctx" >"$T/logs/buildah-standin.log" 2>&1 ||
		! ctr_k8s images import "$T/images/aws-standin.tar.tmp" >>"$T/logs/buildah-standin.log" 2>&1; then
		REASON="stand-in image build or import failed: $(tail -3 "$T/logs/buildah-standin.log" | paste -sd'|')"
		return 1
	fi
	mv "$T/images/aws-standin.tar.tmp" "$T/images/aws-standin.tar"
}

# standin_chart: the stand-in's chart installed as the AWS chart is, on every
# node whose containerd has its image (standin_image).
standin_chart() {
	helm install "$STANDIN_RELEASE" "$HERE/aws-standin/chart" -n "$NS" --set "sysfsHostPath=$FIXTURES/sys" >/dev/null && return 0
	REASON="helm install of the stand-in failed"
	return 1
}

# standin_install: the AWS chart's DaemonSet running the stand-in, registered
# with all 4 EFAs under their ibdev names.
standin_install() {
	local want
	standin_image && standin_chart || return 1
	if ! wait_until 60 has_ready_plugin_pod "$NODE" "name=$STANDIN_RELEASE"; then
		REASON="stand-in pod not Ready within 60s: $(kns get pods -l "name=$STANDIN_RELEASE" -o wide 2>&1 | tail -n +2 | paste -sd'|')"
		return 1
	fi
	allocatable_settles_at_4 "with the stand-in" || return 1
	want=$(efa_ibdevs)
	if [[ $(registered_ids) != "$want" ]]; then
		REASON="the kubelet registered [$(registered_ids)] from the stand-in, want [$want]"
		return 1
	fi
}

registered_ids() {
	python3 "$HERE/lib/kubeinfo.py" registered "$DP_DIR/kubelet_internal_checkpoint" "$RESOURCE" 2>/dev/null |
		paste -sd' '
}

standin_uninstall() {
	helm uninstall "$STANDIN_RELEASE" -n "$NS" --wait >/dev/null || { REASON="helm uninstall of the stand-in failed"; return 1; }
	wait_until 60 no_standin_pod || { REASON="stand-in pod still there 60s after helm uninstall"; return 1; }
}

no_standin_pod() { [[ -z $(kns get pods -l "name=$STANDIN_RELEASE" -o name 2>/dev/null) ]]; }

# standin_with_holder: the stand-in installed and H holding 2 EFAs through
# it; sets H_NODES (what H's container sees) and H_IDS.
standin_with_holder() {
	standin_install && start_pod "$H" 2 || return 1
	H_NODES=$POD_NODES
	H_IDS=("${POD_IDS[@]}")
}

# cloudwatch_lookup: what CloudWatch's agent would find, into LOOKUP.
cloudwatch_lookup() {
	standin_binary || return 1
	if ! LOOKUP=$("$STANDIN" lookup --sysfs-root "$FIXTURES/sys" 2>&1); then
		REASON="PodResources lookup failed: $LOOKUP"
		return 1
	fi
}

# pod_nodes POD: what the pod's container sees in /dev/infiniband now.
pod_nodes() { k exec "$1" -- ls -l /dev/infiniband 2>/dev/null | listing_entries; }

# holder_intact NODES: H still runs and still sees exactly NODES.
holder_intact() {
	local now
	if ! pod_phase_is "$H" Running; then
		REASON="holder $H is $(pod_field "$H" '{.status.phase}'), want Running"
		return 1
	fi
	now=$(pod_nodes "$H")
	if [[ $now != "$1" ]]; then
		REASON="holder $H now sees [$(paste -sd';' <<<"$now")] in /dev/infiniband, had [$(paste -sd';' <<<"$1")]"
		return 1
	fi
}

# new_pod_gets_free HOLDER_NODES: a new pod asking for 2 gets exactly the 2
# EFAs whose nodes the holder does not see. Sets POD_IDS.
new_pod_gets_free() {
	local all shared
	start_pod "$N" 2 || return 1
	shared=$(comm -12 <(sort <<<"$1") <(sort <<<"$POD_NODES"))
	all=$(sort <<<"$1"$'\n'"$POD_NODES")
	# shellcheck disable=SC2046 # one word per ID
	if [[ -n $shared || $all != "$(expected_entries $(efa_ibdevs))" ]]; then
		REASON="new pod $N [${POD_IDS[*]}] sees [$(paste -sd';' <<<"$POD_NODES")], holder sees [$(paste -sd';' <<<"$1")]: ${shared:+both see $(paste -sd';' <<<"$shared")}"
		return 1
	fi
}

readyz_code() {
	curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$(pod_field "$1" '{.status.podIP}' "$NS"):9465/readyz"
}

# sampler_start FILE: records "epoch-ms allocatable" lines into FILE, every
# 0.2s, until sampler_stop.
sampler_start() {
	(while :; do
		echo "$(now_ms) $(allocatable)"
		sleep 0.2
	done) >"$1" 2>/dev/null 9>&- &
	SAMPLER=$!
}

sampler_stop() {
	[[ -n $SAMPLER ]] || return 0
	kill "$SAMPLER" 2>/dev/null
	wait "$SAMPLER" 2>/dev/null
	SAMPLER=
}

# below_4 FILE: how long the samples showed fewer than 4 allocatable, and
# the lowest figure ("" counts as 0), as "SECONDS LOWEST".
below_4() {
	awk 'NR > 1 && prev != 4 { ms += $1 - t }
		{ t = $1; prev = ($2 == "" ? 0 : $2); if (NR == 1 || prev < low) low = prev }
		END { printf "%.1f %d\n", ms / 1000, low }' "$1"
}

# kubelet_gap SINCE: from the kubelet's log after line SINCE, the seconds
# between each "Endpoint became unhealthy" of the resource and the next
# "Device plugin connected": how long the kubelet counted no EFA allocatable,
# which the node object, posted every NODE_STATUS_PERIOD, may not show.
kubelet_gap() {
	tail -n +"$(($1 + 1))" "$T/logs/kubelet-$NODE.log" | grep -F "\"$RESOURCE\"" |
		awk '/Endpoint became unhealthy/ && !down { split($2, a, ":"); down = 1; t = a[1] * 3600 + a[2] * 60 + a[3] }
			/Device plugin connected/ && down { split($2, a, ":"); gap += a[1] * 3600 + a[2] * 60 + a[3] - t; down = 0 }
			END { printf "%.3f\n", gap }'
}

kubelet_registrations() {
	tail -n +"$(($1 + 1))" "$T/logs/kubelet-$NODE.log" | grep -c "Got registration request from device plugin with resource.*\"$RESOURCE\""
}

kubelet_log_lines() { wc -l <"$T/logs/kubelet-$NODE.log"; }

# on_clean_node FN: runs FN between two resets: no pod in the default
# namespace, neither plugin installed. Returns FN's status.
on_clean_node() {
	local rc
	migration_reset
	"$1"
	rc=$?
	sampler_stop
	migration_reset
	return "$rc"
}

migration_reset() {
	k -n default delete pods --all --wait --timeout=60s >/dev/null 2>&1
	helm uninstall "$STANDIN_RELEASE" -n "$NS" --wait >/dev/null 2>&1
	uninstall_plugin
	wait_until 60 no_standin_pod
}

# ---------------------------------------------------------------- cases

migration_documented() {
	local mark data id
	standin_with_holder || return 1
	mark=$(kubelet_log_lines)
	sampler_start "$T/allocatable-readme"
	# The steps of docs/migration.md, in order.
	standin_uninstall || return 1
	ours_install || return 1
	ours_rolled_out || return 1
	sampler_stop
	holder_intact "$H_NODES" || return 1
	new_pod_gets_free "$H_NODES" || return 1
	cloudwatch_lookup || return 1
	for id in $(allocated_ids "$(pod_field "$H" '{.metadata.uid}')"); do
		if ! grep -qx "$id default/$H/probe" <<<"$LOOKUP"; then
			REASON="PodResources does not show $H holding the ibdev name $id: $(paste -sd'|' <<<"$LOOKUP")"
			return 1
		fi
	done
	read -r data <<<"$(below_4 "$T/allocatable-readme")"
	CASE_DETAIL="node showed fewer than 4 allocatable for ${data% *}s (lowest ${data#* }), the kubelet counted none for $(kubelet_gap "$mark")s; H holds $(allocated_ids "$(pod_field "$H" '{.metadata.uid}')")"
}

migration_ours_first() {
	local pod mark first last reg comp readyz errors end gone ready_ms n=0 below
	standin_with_holder || return 1
	mark=$(kubelet_log_lines)
	sampler_start "$T/allocatable-ours-first"
	ours_install || return 1
	if ! wait_until 120 has_ready_plugin_pod; then
		REASON="no Ready $OURS_RELEASE pod within 120s with the stand-in running: $(kns get pods -o wide 2>&1 | tail -n +2 | paste -sd'|'); $(plugin_events)"
		return 1
	fi
	pod=$(ready_plugin_pod)
	wait_until 10 metric "$pod" efa_device_plugin_registrations_total >/dev/null
	first=$(metric "$pod" efa_device_plugin_registrations_total)
	end=$((SECONDS + 60))
	while ((SECONDS < end)); do
		reg=$(metric "$pod" efa_device_plugin_registrations_total)
		comp=$(metric "$pod" efa_device_plugin_competing_plugin)
		n=$((n + 1))
		if [[ $comp != 1 ]]; then
			REASON="efa_device_plugin_competing_plugin is '$comp' after $((60 - end + SECONDS))s with the stand-in running, want 1"
			return 1
		fi
		if ! [[ $reg =~ ^[0-9]+$ && $first =~ ^[0-9]+$ ]] || ((reg > first + 1)); then
			REASON="efa_device_plugin_registrations_total went from '$first' to '$reg' within 60s of the stand-in, want at most one more"
			return 1
		fi
		if ! allocatable_is 4; then
			REASON="allocatable fell to '$(allocatable)' with both plugins installed"
			return 1
		fi
		sleep 2
	done
	last=$reg
	readyz=$(readyz_code "$pod")
	errors=$(k -n "$NS" logs "$pod" 2>/dev/null | grep -i error | grep -c aws-efa-device-plugin.sock)
	if ((errors == 0)); then
		REASON="no error line naming aws-efa-device-plugin.sock in $pod's log"
		return 1
	fi
	note "ours first, 60s with both: registrations_total $first -> $last ($n samples), competing_plugin 1, kubelet registrations $(kubelet_registrations "$mark"), /readyz $readyz, $errors error line(s) naming the competitor"
	sampler_stop
	below=$(below_4 "$T/allocatable-ours-first")

	mark=$(kubelet_log_lines)
	sampler_start "$T/allocatable-standin-gone"
	standin_uninstall || return 1
	gone=$(now_ms)
	if ! wait_until 10 ready_again "$pod"; then
		REASON="$pod not Ready with /readyz 200 within 10s of the stand-in's uninstall: /readyz $(readyz_code "$pod"), Ready $(pod_field "$pod" '{.status.conditions[?(@.type=="Ready")].status}' "$NS")"
		return 1
	fi
	ready_ms=$(($(now_ms) - gone))
	if ! wait_until $((NODE_STATUS_PERIOD + 5)) allocatable_is 4; then
		REASON="allocatable is '$(allocatable)' after the stand-in left, want 4"
		return 1
	fi
	sampler_stop
	holder_intact "$H_NODES" || return 1
	new_pod_gets_free "$H_NODES" || return 1
	read -r below <<<"$below"
	CASE_DETAIL="with both for 60s: registrations_total $first -> $last, allocatable never below 4 (${below% *}s below); stand-in gone: Ready with /readyz 200 after $((ready_ms / 1000)).$(printf '%03d' $((ready_ms % 1000)))s, registrations_total $(metric "$pod" efa_device_plugin_registrations_total), kubelet registrations $(kubelet_registrations "$mark"), the kubelet counted none for $(kubelet_gap "$mark")s, node below 4 for $(below_4 "$T/allocatable-standin-gone" | cut -d' ' -f1)s"
}

ready_again() {
	[[ $(readyz_code "$1") == 200 ]] &&
		[[ $(pod_field "$1" '{.status.conditions[?(@.type=="Ready")].status}' "$NS") == True ]]
}

migration_pci() {
	local pod foreign try warnings data
	standin_with_holder || return 1
	sampler_start "$T/allocatable-pci"
	standin_uninstall || return 1
	ours_install --set config.device-id-strategy=pci || return 1
	ours_rolled_out || return 1
	sampler_stop
	pod=$(ready_plugin_pod)
	if ! wait_until 60 foreign_is "$pod" 2; then
		REASON="efa_device_plugin_foreign_allocations is '$(metric "$pod" efa_device_plugin_foreign_allocations)' while $H holds ${H_IDS[*]}, want 2"
		return 1
	fi
	foreign=$(metric "$pod" efa_device_plugin_foreign_allocations)
	for try in 1 2 3; do
		if ! new_pod_gets_free "$H_NODES"; then
			REASON="try $try: $REASON"
			return 1
		fi
		if [[ ${POD_IDS[0]} != 0000:* ]]; then
			REASON="try $try: $N holds [${POD_IDS[*]}], want PCI addresses under device-id-strategy pci"
			return 1
		fi
		k delete pod "$N" --wait >/dev/null || { REASON="cannot delete $N"; return 1; }
	done
	# The chart logs JSON lines; the warning names the pod in its namespace
	# and pod fields.
	warnings=$(k -n "$NS" logs "$pod" 2>/dev/null | grep -F '"level":"WARN"' | grep -F '"namespace":"default"' |
		grep -F "\"pod\":\"$H\"" | grep -w -- "${H_IDS[0]}" | grep -cw -- "${H_IDS[1]}")
	if ((warnings == 0)); then
		REASON="no warning in $pod's log naming namespace default, pod $H and ${H_IDS[*]}: $(k -n "$NS" logs "$pod" 2>/dev/null | grep -i warn | tail -2 | paste -sd'|')"
		return 1
	fi
	read -r data <<<"$(below_4 "$T/allocatable-pci")"
	CASE_DETAIL="foreign_allocations $foreign; $warnings warning line(s) naming default/$H and its IDs; node below 4 for ${data% *}s (lowest ${data#* })"
}

foreign_is() { [[ $(metric "$1" efa_device_plugin_foreign_allocations) == "$2" ]]; }

migration_cloudwatch() {
	local want h_ids name
	standin_binary || return 1
	ours_install || return 1
	ours_rolled_out || return 1
	start_pod "$H" 2 || return 1
	h_ids=" ${POD_IDS[*]} "
	cloudwatch_lookup || return 1
	want=$(for name in $(efa_ibdevs); do
		if [[ $h_ids == *" $name "* ]]; then echo "$name default/$H/probe"; else echo "$name -"; fi
	done)
	if [[ $(sort <<<"$LOOKUP") != "$(sort <<<"$want")" ]]; then
		REASON="the lookup answers [$(paste -sd'|' <<<"$LOOKUP")], want [$(paste -sd'|' <<<"$want")]"
		return 1
	fi
	CASE_DETAIL=$(paste -sd',' <<<"$LOOKUP")
}

case_migration_documented() { on_clean_node migration_documented; }
case_migration_ours_first() { on_clean_node migration_ours_first; }
case_migration_pci() { on_clean_node migration_pci; }
case_migration_cloudwatch() { on_clean_node migration_cloudwatch; }
