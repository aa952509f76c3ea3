# shellcheck shell=bash
# The topology suite's pods and what it reads back about them: pod phase and
# reason, the checkpoint's device IDs with their NUMA keys, the kubelet's
# TopologyHints lines, our plugin's GetPreferredAllocation answers and the GPU
# stand-in's variable inside each container. Sourced by topology.sh.
# shellcheck disable=SC2034 # REASON, POD_* and GPA_* are the cases'

# write_topo_pod NAME CONTAINER...: a static pod. Each CONTAINER is
# KIND:NAME:EFAS:GPUS[:CPUS], KIND "init" or "app"; without CPUS the pod is
# BestEffort, and a pod whose every container names CPUS is Guaranteed. Every
# container writes the GPU stand-in's variable, its /dev/infiniband and the
# CPUs it may run on into $T/out/NAME/; app containers then sleep.
write_topo_pod() {
	local name=$1 spec kind cname efas gpus cpus limits rest init=() apps=() json
	shift
	mkdir -p "$T/out/$name"
	for spec in "$@"; do
		IFS=: read -r kind cname efas gpus cpus <<<"$spec"
		limits=()
		((efas > 0)) && limits+=("\"$RESOURCE\": $efas")
		((gpus > 0)) && limits+=("\"$GPU\": $gpus")
		((${cpus:-0} > 0)) && limits+=("\"cpu\": \"$cpus\"" '"memory": "32Mi"')
		rest="exec sleep 100000"
		[[ $kind == init ]] && rest="true"
		json=$(
			IFS=,
			cat <<-EOF
				{"name": "$cname", "image": "localhost/busybox:1", "imagePullPolicy": "Never",
				 "command": ["sh", "-c", "echo \"\${$GPU_ENV-}\" >/out/$cname.gpu; sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status >/out/$cname.cpus; ls /dev/infiniband >/out/$cname.ls 2>&1; $rest"],
				 "resources": {"limits": {${limits[*]}}},
				 "volumeMounts": [{"name": "out", "mountPath": "/out"}]}
			EOF
		)
		if [[ $kind == init ]]; then init+=("$json"); else apps+=("$json"); fi
	done
	(
		IFS=,
		cat >"$T/manifests.tmp/$name.json" <<-EOF
			{"apiVersion": "v1", "kind": "Pod",
			 "metadata": {"name": "$name", "namespace": "default"},
			 "spec": {
			  "hostNetwork": true, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
			  "initContainers": [${init[*]}],
			  "containers": [${apps[*]}],
			  "volumes": [{"name": "out", "hostPath": {"path": "$T/out/$name", "type": "Directory"}}]}}
		EOF
	)
	# A rename, so the kubelet never reads a half-written manifest.
	mv "$T/manifests.tmp/$name.json" "$T/manifests/$name.json"
}

pod_settled() { [[ $(pod_status "$1" | cut -f1) =~ ^(Running|Failed|Succeeded)$ ]]; }

# run_pod NAME CONTAINER...: writes the pod and waits until it runs or is
# rejected. Sets POD_PHASE, POD_REASON, POD_UID, POD_MESSAGE, and GPA_SEEN,
# the number of answers our plugin had logged before.
run_pod() {
	local name=$1 status
	GPA_SEEN=$(gpa_answers 0 | wc -l)
	write_topo_pod "$@"
	wait_until 60 pod_settled "$name"
	status=$(pod_status "$name")
	IFS=$'\t' read -r POD_PHASE POD_REASON POD_UID POD_MESSAGE <<<"$status"
}

# expect_running NAME CONTAINER...: run_pod, and the pod must run with each
# app container having written its files.
expect_running() {
	local name=$1 spec cname
	run_pod "$@"
	if [[ $POD_PHASE != Running ]]; then
		REASON="pod $name is $POD_PHASE ($POD_REASON: $POD_MESSAGE), want Running"
		return 1
	fi
	shift
	for spec in "$@"; do
		cname=$(cut -d: -f2 <<<"$spec")
		if ! wait_until 20 test -e "$T/out/$name/$cname.ls"; then
			REASON="container $cname of pod $name wrote nothing"
			return 1
		fi
	done
}

# expect_rejected NAME REASON CONTAINER...: run_pod, and the kubelet must
# reject the pod with REASON.
expect_rejected() {
	local name=$1 want=$2
	shift 2
	run_pod "$name" "$@"
	if [[ $POD_PHASE != Failed || $POD_REASON != "$want" ]]; then
		REASON="pod $name is $POD_PHASE ($POD_REASON: $POD_MESSAGE), want Failed ($want)"
		return 1
	fi
}

# fixture_ids_of NAME [NUMA]: the IDs of fixture NAME (on node NUMA only),
# sorted as the checkpoint's reader sorts them.
fixture_ids_of() {
	awk -v numa="${2-any}" 'numa == "any" || $2 == numa {print $1}' "$T/$1/ids" | LC_ALL=C sort | paste -sd' '
}

# numa_of ID: the NUMA node our plugin reports for ID in the current fixture.
numa_of() { awk -v id="$1" '$1 == id {print $2}' "$T/$FIXTURE/ids"; }

# switch_of ID: the PCIe switch above ID in the p5en fixture.
switch_of() { echo "${FAKE_SWITCH[$(awk -v id="$1" '$1 == id {print $3}' "$T/p5en/ids")]}"; }

# devices_of NAME RESOURCE [CONTAINER]: "CONTAINER NUMA ID" lines the
# checkpoint holds for the pod (and container).
devices_of() {
	python3 "$HERE/lib/kubeinfo.py" devices "$CHECKPOINT" "$(pod_status "$1" | cut -f3)" "$2" 2>/dev/null |
		awk -v c="${3-}" 'c == "" || $1 == c'
}

# ids_of NAME RESOURCE [CONTAINER]: the IDs alone, space-separated, sorted.
ids_of() { devices_of "$@" | awk '{print $3}' | LC_ALL=C sort | paste -sd' '; }

# numa_keys_of NAME RESOURCE [CONTAINER]: the distinct NUMA keys.
numa_keys_of() { devices_of "$@" | awk '{print $2}' | sort -u | paste -sd' '; }

# gpu_env_of NAME CONTAINER: the stand-in's variable as the container saw it.
gpu_env_of() { cat "$T/out/$1/$2.gpu" 2>/dev/null; }

# cpus_of NAME CONTAINER: the CPU list the container was allowed to run on.
cpus_of() { cat "$T/out/$1/$2.cpus" 2>/dev/null; }

# gpa_answers SKIP: our plugin's answers after the first SKIP (observe.py gpa).
gpa_answers() { python3 "$HERE/topology/observe.py" gpa "$(plugin_log)" "$1"; }

# new_gpa: the answers logged since run_pod started the last pod.
new_gpa() { gpa_answers "$GPA_SEEN"; }

# hints_of NAME RESOURCE: the kubelet's hint masks for the pod (observe.py hints).
hints_of() { python3 "$HERE/topology/observe.py" hints "$(kubelet_log)" "$1-$NODE" "$2"; }

# sorted_csv LIST: a comma-separated LIST as sorted, space-separated IDs.
sorted_csv() { tr ',' '\n' <<<"$1" | sed '/^$/d' | LC_ALL=C sort | paste -sd' '; }
