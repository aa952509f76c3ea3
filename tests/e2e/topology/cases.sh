# shellcheck shell=bash
# The topology suite's cases (T0-T11 of the GPU-EFA alignment issue). Each
# starts from no pods and names the policy, scope and fixture it needs; the
# runner orders them so the kubelet restarts once per policy group. Exact
# device IDs are asserted only where our GetPreferredAllocation answer
# decides (the request is smaller than the aligned set); elsewhere the
# kubelet picks at random and only the NUMA nodes are asserted.
# Sourced by topology.sh.
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are run_case's

# fresh POLICY SCOPE FIXTURE [CPU_POLICY]: no pods, the kubelet under POLICY
# and SCOPE (and the CPU manager policy, default none), our plugin on FIXTURE.
fresh() {
	remove_pods && use_policy "$1" "$2" "${4:-none}" && use_fixture "$3"
}

drop_pod() {
	remove_pod "$1" || { REASON="pod $1 still listed 60s after its manifest was removed"; return 1; }
	rm -rf "${T:?}/out/$1"
}

# hold_gpu0 NAME: a pod NAME-gpu holding GPU-0; on a free node every policy
# puts a 1-GPU pod on the lower NUMA node. Pod names are unique in a run: a
# static pod's UID comes from its manifest, and the kubelet would hand a
# recreated pod the devices its checkpoint still holds for that UID.
hold_gpu0() {
	expect_running "$1-gpu" app:hold:0:1 || return 1
	[[ $(ids_of "$1-gpu" "$GPU") == GPU-0 ]] || { REASON="the GPU holder got [$(ids_of "$1-gpu" "$GPU")], want GPU-0"; return 1; }
}

# gpa_summary: the answers since the last run_pod, for the case's line.
gpa_summary() {
	local offered must size answer out=()
	while IFS='|' read -r offered must size answer; do
		out+=("GPA offered [$offered] must [$must] size $size -> [$answer]")
	done < <(new_gpa)
	((${#out[@]} > 0)) || out=("no GPA call")
	local IFS=';'
	echo "${out[*]}"
}

# expect_one_gpa OFFERED MUST SIZE: exactly one answer since the last
# run_pod, for an offer of exactly OFFERED (space-separated, any order) with
# MUST to keep and SIZE. Sets GPA_ANSWER (sorted, space-separated).
expect_one_gpa() {
	local want_offered=$1 want_must=$2 want_size=$3 offered must size answer n
	n=$(new_gpa | wc -l)
	if ((n != 1)); then
		REASON="$n GetPreferredAllocation answers logged, want 1: $(gpa_summary)"
		return 1
	fi
	IFS='|' read -r offered must size answer < <(new_gpa)
	if [[ $(sorted_csv "$offered") != "$want_offered" || $(sorted_csv "$must") != "$want_must" || $size != "$want_size" ]]; then
		REASON="the kubelet offered [$offered] must [$must] size $size, want [$want_offered] must [$want_must] size $want_size"
		return 1
	fi
	GPA_ANSWER=$(sorted_csv "$answer")
}

# expect_devices NAME RESOURCE CONTAINER IDS NUMA_KEYS: the checkpoint gives
# the container exactly IDS ("*": any), under exactly NUMA_KEYS.
expect_devices() {
	local got keys
	got=$(ids_of "$1" "$2" "$3")
	keys=$(numa_keys_of "$1" "$2" "$3")
	if [[ ($4 != "*" && $got != "$4") || $keys != "$5" ]]; then
		REASON="checkpoint gives ${3:-pod} $1 $2 [$got] under NUMA keys [$keys], want [$4] under [$5]"
		return 1
	fi
}

# expect_gpu1_job NAME IDS NUMA: container job of the pod got EFAs IDS
# under key NUMA, and GPU-1 (key 1), which it also sees in the stand-in's
# variable.
expect_gpu1_job() {
	expect_devices "$1" "$RESOURCE" job "$2" "$3" &&
		expect_devices "$1" "$GPU" job GPU-1 1 &&
		expect_gpu_env "$1" job GPU-1
}

# expect_gpu_env NAME CONTAINER IDS: the stand-in's variable in the container.
expect_gpu_env() {
	local got
	got=$(gpu_env_of "$1" "$2")
	[[ $got == "$3" ]] || { REASON="$GPU_ENV in $1/$2 is [$got], want [$3]"; return 1; }
}

# ---------------------------------------------------------------- cases
# T1-T10 run BestEffort pods: device alignment is not limited to Guaranteed
# ones. T11 is the one Guaranteed pod, for the CPU manager.

# T0: the kubelet sees two NUMA nodes: its hints for one EFA include node 1
# alone, and with everything free it picks node 0 and offers GPA only that
# node's EFAs.
case_hints_see_two_nodes() {
	fresh single-numa-node container p4d || return 1
	expect_running t0 app:net:1:0 || return 1
	local hints
	hints=$(hints_of t0 "$RESOURCE")
	if ! grep -qE '(^| )1:true( |$)' <<<"$hints"; then
		REASON="kubelet hints for $RESOURCE: [$hints], want a preferred hint for node 1 alone"
		return 1
	fi
	expect_one_gpa "$(fixture_ids_of p4d 0)" "" 1 || return 1
	expect_devices t0 "$RESOURCE" net "$GPA_ANSWER" 0 || return 1
	CASE_DETAIL="hints [$hints]; $(gpa_summary); got [$GPA_ANSWER] on node 0"
}

# T1: GPU-0 held; 1 GPU + 1 EFA gets GPU-1 and the NUMA-1 EFA our GPA
# prefers, three times over.
case_efa_follows_the_free_gpu() {
	fresh single-numa-node container p4d && hold_gpu0 t1 || return 1
	local pod runs=()
	for pod in t1a t1b t1c; do
		expect_running "$pod" app:job:1:1 || return 1
		expect_one_gpa "$(fixture_ids_of p4d 1)" "" 1 &&
			expect_gpu1_job "$pod" "$GPA_ANSWER" 1 || return 1
		runs+=("GPU-1 + [$GPA_ANSWER] (key 1), $(gpa_summary)")
		drop_pod "$pod" || return 1
	done
	local IFS='|'
	CASE_DETAIL="${runs[*]}"
}

# T2: GPU-0 held; 1 GPU + 2 EFA gets GPU-1 and both NUMA-1 EFAs.
case_both_efas_of_the_gpu_node() {
	fresh single-numa-node container p4d && hold_gpu0 t2 || return 1
	expect_running t2 app:job:2:1 || return 1
	expect_gpu1_job t2 "$(fixture_ids_of p4d 1)" 1 || return 1
	CASE_DETAIL="GPU-1 + [$(ids_of t2 "$RESOURCE")] (key 1); $(gpa_summary)"
}

# T2b: p5en, GPU-0 held; 1 GPU + 2 EFA gets two NUMA-1 EFAs behind one switch.
case_p5en_pair_behind_one_switch() {
	fresh single-numa-node container p5en && hold_gpu0 t2b || return 1
	expect_running t2b app:job:2:1 || return 1
	expect_one_gpa "$(fixture_ids_of p5en 1)" "" 2 &&
		expect_devices t2b "$RESOURCE" job "$GPA_ANSWER" 1 &&
		expect_devices t2b "$GPU" job GPU-1 1 || return 1
	local a b
	read -r a b <<<"$GPA_ANSWER"
	if [[ $(switch_of "$a") != "$(switch_of "$b")" ]]; then
		REASON="[$GPA_ANSWER] are behind switches $(switch_of "$a") and $(switch_of "$b"), want one"
		return 1
	fi
	CASE_DETAIL="GPU-1 + [$GPA_ANSWER] behind $(switch_of "$a"); $(gpa_summary)"
}

# expect_locality_error NAME CONTAINER...: rejected by the Topology Manager.
expect_locality_error() {
	expect_rejected "$1" TopologyAffinityError "${@:2}" || return 1
	if [[ $POD_MESSAGE != *"Resources cannot be allocated with Topology locality"* ]]; then
		REASON="pod $1 rejected with message [$POD_MESSAGE]"
		return 1
	fi
	CASE_DETAIL="$POD_PHASE/$POD_REASON: $POD_MESSAGE"
}

# T3: single-numa-node: 3 EFA fit no single node.
case_three_efas_fit_no_node() {
	fresh single-numa-node container p4d || return 1
	expect_locality_error t3 app:job:3:0
}

# T4: restricted: 3 EFA run on both nodes, the 3 our GPA picks of all 4.
case_restricted_spans_both_nodes() {
	fresh restricted container p4d || return 1
	expect_running t4 app:job:3:0 || return 1
	expect_one_gpa "$(fixture_ids_of p4d)" "" 3 &&
		expect_devices t4 "$RESOURCE" job "$GPA_ANSWER" "0 1" || return 1
	CASE_DETAIL="[$GPA_ANSWER] (keys 0 1); $(gpa_summary)"
}

# T5: 1 GPU + 3 EFA on an empty node: restricted rejects (the GPU's narrowest
# mask is one node, the EFAs' two), best-effort admits.
case_restricted_rejects_gpu_with_three_efas() {
	fresh restricted container p4d || return 1
	expect_locality_error t5r app:job:3:1
}

case_best_effort_admits_gpu_with_three_efas() {
	fresh best-effort container p4d || return 1
	expect_running t5b app:job:3:1 || return 1
	expect_devices t5b "$RESOURCE" job "*" "0 1" || return 1
	CASE_DETAIL="GPU [$(ids_of t5b "$GPU")] + [$(ids_of t5b "$RESOURCE")] (keys $(numa_keys_of t5b "$RESOURCE")); $(gpa_summary)"
}

# hold_gpu0_and_a_numa1_efa NAME: GPU-0 and one NUMA-1 EFA held, GPU-1 and the NUMA-0 EFAs
# free. A 2-EFA pod fills node 0 first (the lower of two preferred masks), so
# a 1-EFA pod then lands on node 1.
hold_gpu0_and_a_numa1_efa() {
	expect_running "$1-2" app:hold:2:0 || return 1
	[[ $(numa_keys_of "$1-2" "$RESOURCE") == 0 ]] || { REASON="the 2-EFA holder is on [$(numa_keys_of "$1-2" "$RESOURCE")], want node 0"; return 1; }
	expect_running "$1-1" app:hold:1:0 || return 1
	[[ $(numa_keys_of "$1-1" "$RESOURCE") == 1 ]] || { REASON="the 1-EFA holder is on [$(numa_keys_of "$1-1" "$RESOURCE")], want node 1"; return 1; }
	drop_pod "$1-2" && hold_gpu0 "$1"
}

# T6: with that, 1 GPU + 2 EFA cannot be aligned: best-effort admits it
# misaligned, restricted and single-numa-node reject it.
case_best_effort_admits_misaligned() {
	fresh best-effort container p4d && hold_gpu0_and_a_numa1_efa t6b || return 1
	expect_running t6b app:job:2:1 || return 1
	expect_gpu1_job t6b "$(fixture_ids_of p4d 0)" 0 || return 1
	CASE_DETAIL="misaligned: GPU-1 (node 1) + [$(ids_of t6b "$RESOURCE")] (node 0); $(gpa_summary)"
}

case_restricted_rejects_misaligned() {
	fresh restricted container p4d && hold_gpu0_and_a_numa1_efa t6r || return 1
	expect_locality_error t6r app:job:2:1
}

case_single_numa_node_rejects_misaligned() {
	fresh single-numa-node container p4d && hold_gpu0_and_a_numa1_efa t6s || return 1
	expect_locality_error t6s app:job:2:1
}

# T7: GPU-0 held; containers gpu (1 GPU) and net (1 EFA). Container scope
# aligns net alone (node 0, the lower); pod scope with the GPU (node 1).
scope_alignment() {
	local pod=$1 scope=$2 node=$3
	fresh single-numa-node "$scope" p4d && hold_gpu0 "$pod" || return 1
	expect_running "$pod" app:gpu:0:1 app:net:1:0 || return 1
	expect_one_gpa "$(fixture_ids_of p4d "$node")" "" 1 &&
		expect_devices "$pod" "$RESOURCE" net "$GPA_ANSWER" "$node" &&
		expect_devices "$pod" "$GPU" gpu GPU-1 1 &&
		expect_gpu_env "$pod" gpu GPU-1 || return 1
	CASE_DETAIL="gpu GPU-1, net [$GPA_ANSWER] (node $node); $(gpa_summary)"
}

case_container_scope_aligns_net_alone() { scope_alignment t7c container 0; }
case_pod_scope_aligns_net_with_gpu() { scope_alignment t7p pod 1; }

# T8: restricted: 5 EFA, more than there are, is a locality error too.
case_too_many_efas_is_a_locality_error() {
	fresh restricted container p4d || return 1
	expect_locality_error t8 app:job:5:0
}

# T9: g5-shaped (no NUMA node): 1 GPU + 2 EFA is admitted; the EFAs are
# under key -1 and our GPA picks them from all four.
case_no_numa_node_admitted() {
	fresh single-numa-node container g5 || return 1
	expect_running t9 app:job:2:1 || return 1
	expect_one_gpa "$(fixture_ids_of g5)" "" 2 &&
		expect_devices t9 "$RESOURCE" job "$GPA_ANSWER" -1 || return 1
	CASE_DETAIL="GPU [$(ids_of t9 "$GPU")] + [$GPA_ANSWER] (key -1); hints [$(hints_of t9 "$RESOURCE")]; $(gpa_summary)"
}

# T10: p5en: an init container's EFA is reused by the app container, which
# gets it plus its switch sibling: GPA with a real must_include.
case_init_efa_reused_with_its_sibling() {
	fresh single-numa-node container p5en || return 1
	expect_running t10 init:setup:1:0 app:job:2:0 || return 1
	local kept app a b
	kept=$(ids_of t10 "$RESOURCE" setup)
	app=$(ids_of t10 "$RESOURCE" job)
	read -r a b <<<"$app"
	if [[ -z $kept || " $app " != *" $kept "* || -z $b || $(switch_of "$a") != "$(switch_of "$b")" ]]; then
		REASON="init got [$kept], app [$app] (switches $(switch_of "$a") $(switch_of "${b:-}")): want the init's EFA and its switch sibling; $(gpa_summary)"
		return 1
	fi
	local last
	last=$(new_gpa | tail -1 | cut -d'|' -f2)
	if [[ $last != "$kept" ]]; then
		REASON="the app container's GPA had must_include [$last], want [$kept]; $(gpa_summary)"
		return 1
	fi
	CASE_DETAIL="init [$kept], app [$app] behind $(switch_of "$a"); $(gpa_summary)"
}

# T11: the static CPU manager with CPU 0 reserved: a Guaranteed pod's one
# exclusive CPU can only be CPU 1, on node 1, so single-numa-node offers GPA
# node 1's EFAs alone, and the container runs on CPU 1.
case_static_cpu_manager_picks_node_1() {
	fresh single-numa-node container p4d static || return 1
	expect_running t11 app:job:1:0:1 || return 1
	expect_one_gpa "$(fixture_ids_of p4d 1)" "" 1 &&
		expect_devices t11 "$RESOURCE" job "$GPA_ANSWER" 1 || return 1
	local cpus
	cpus=$(cpus_of t11 job)
	[[ $cpus == 1 ]] || { REASON="container job runs on CPUs [$cpus], want [1]"; return 1; }
	CASE_DETAIL="CPU $cpus + [$GPA_ANSWER] (key 1); hints [$(hints_of t11 "$RESOURCE")]; $(gpa_summary)"
}

run_topology_cases() {
	run_case "T0 single-numa-node: kubelet hints include node 1 alone; 1 EFA offered node 0 only" case_hints_see_two_nodes
	run_case "T1 single-numa-node: GPU-0 held; 1 GPU + 1 EFA -> GPU-1 + our NUMA-1 pick, x3" case_efa_follows_the_free_gpu
	run_case "T2 single-numa-node: GPU-0 held; 1 GPU + 2 EFA -> both NUMA-1 EFAs" case_both_efas_of_the_gpu_node
	run_case "T3 single-numa-node: 3 EFA -> TopologyAffinityError" case_three_efas_fit_no_node
	run_case "T6 single-numa-node: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> rejected" case_single_numa_node_rejects_misaligned
	run_case "T7 single-numa-node, container scope: net gets a NUMA-0 EFA" case_container_scope_aligns_net_alone
	run_case "T2b single-numa-node, p5en: GPU-0 held; 1 GPU + 2 EFA -> one NUMA-1 switch" case_p5en_pair_behind_one_switch
	run_case "T10 single-numa-node, p5en: init 1 EFA, app 2 -> the init's EFA + its switch sibling" case_init_efa_reused_with_its_sibling
	run_case "T9 single-numa-node, g5 (no NUMA): 1 GPU + 2 EFA admitted" case_no_numa_node_admitted
	run_case "T7 single-numa-node, pod scope: net gets a NUMA-1 EFA" case_pod_scope_aligns_net_with_gpu
	run_case "T4 restricted: 3 EFA run on both nodes" case_restricted_spans_both_nodes
	run_case "T5 restricted: 1 GPU + 3 EFA on an empty node -> rejected" case_restricted_rejects_gpu_with_three_efas
	run_case "T6 restricted: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> rejected" case_restricted_rejects_misaligned
	run_case "T8 restricted: 5 EFA -> TopologyAffinityError, not UnexpectedAdmissionError" case_too_many_efas_is_a_locality_error
	run_case "T5 best-effort: 1 GPU + 3 EFA on an empty node -> admitted" case_best_effort_admits_gpu_with_three_efas
	run_case "T6 best-effort: GPU-0 + a NUMA-1 EFA held; 1 GPU + 2 EFA -> admitted misaligned" case_best_effort_admits_misaligned
	run_case "T11 single-numa-node, static CPU manager: Guaranteed 1 CPU + 1 EFA -> CPU 1 + a NUMA-1 EFA" case_static_cpu_manager_picks_node_1
}
