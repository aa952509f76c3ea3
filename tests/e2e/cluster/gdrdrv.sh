# shellcheck shell=bash
# shellcheck disable=SC2034 # REASON and CASE_DETAIL are read by run_case (lib/host.sh)
# GPU-initiated networking without privileged: the chart installed as
# docs/gpu-initiated-networking.md shows it, extra-device-nodes:
# [/dev/gdrdrv] with the node mounted into the plugin pod, and a Job asking
# for EFAs sees /dev/gdrdrv, with the host's number, next to exactly its
# uverbs nodes.
#
# Sourced by cluster.sh. The case stands alone: it installs its own release
# and removes it, and the node, when it ends.

GDRDRV=/dev/gdrdrv
# A major no driver of the suite's host holds (gdrdrv's own is dynamic): the
# container only lists the node, it never opens it.
GDRDRV_MAJOR=235

# The suite's chart values plus the docs' settings for /dev/gdrdrv; the
# lists are the suite's with the node added, as Helm replaces a list whole.
gdrdrv_values() {
	python3 - "$TEST_VALUES" "$GDRDRV" <<-'EOF'
		import sys, yaml
		values, node = yaml.safe_load(open(sys.argv[1])), sys.argv[2]
		values.setdefault("config", {})["extra-device-nodes"] = [node]
		values["extraVolumes"].append({"name": "gdrdrv", "hostPath": {"path": node, "type": "CharDevice"}})
		values["extraVolumeMounts"].append({"name": "gdrdrv", "mountPath": node, "readOnly": True})
		yaml.safe_dump(values, sys.stdout)
	EOF
}

# gdrdrv_job: a Job holding 2 EFAs whose container also lists GDRDRV.
gdrdrv_job() { workload_json gdrdrv-job job 2 --list "$GDRDRV" | k apply -f -; }

gdrdrv_cleanup() {
	k delete job gdrdrv-job --ignore-not-found --wait >/dev/null 2>&1
	helm uninstall gdrdrv -n "$NS" --wait >/dev/null 2>&1
	rm -f "$GDRDRV"
}

case_gdrdrv() {
	local pod uid ids got want
	# A real GDRCopy on the suite's host is left alone.
	[[ ! -e $GDRDRV ]] || { REASON="$GDRDRV exists on this host; the case makes its own"; return 1; }
	uninstall_plugin || return 1
	mknod -m 666 "$GDRDRV" c "$GDRDRV_MAJOR" 0 || { REASON="cannot create $GDRDRV"; return 1; }
	gdrdrv_values >"$T/values-gdrdrv.yaml" || { REASON="cannot write the chart values"; gdrdrv_cleanup; return 1; }
	helm template gdrdrv "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$T/values-gdrdrv.yaml" >"$T/helm-gdrdrv.yaml"
	if ! helm install gdrdrv "$REPO/manifests/helm/efa-device-plugin" -n "$NS" -f "$T/values-gdrdrv.yaml" >/dev/null; then
		REASON="helm install with extra-device-nodes failed"
		gdrdrv_cleanup
		return 1
	fi
	plugin_installed_ok "$T/helm-gdrdrv.yaml" || { gdrdrv_cleanup; return 1; }
	gdrdrv_job >/dev/null || { REASON="Job gdrdrv-job not accepted"; gdrdrv_cleanup; return 1; }
	if ! wait_until 60 job_pod_running gdrdrv-job; then
		REASON="Job gdrdrv-job has no Running pod within 60s: $(k get pods -l job-name=gdrdrv-job -o wide 2>&1 | tail -1)"
		gdrdrv_cleanup
		return 1
	fi
	pod=$(job_pod gdrdrv-job)
	uid=$(pod_field "$pod" '{.metadata.uid}')
	read -ra ids <<<"$(allocated_ids "$uid")"
	wait_until 20 has_listing "$pod"
	k logs "$pod" >"$T/logs/pod-gdrdrv.log"
	got=$(listing_entries <"$T/logs/pod-gdrdrv.log")
	want=$({
		expected_entries "${ids[@]}"
		echo "c $GDRDRV_MAJOR 0 $GDRDRV"
	} | sort)
	gdrdrv_cleanup
	if ((${#ids[@]} != 2)) || [[ $got != "$want" ]]; then
		REASON="pod $pod (EFAs [${ids[*]}]) sees [$(paste -sd';' <<<"$got")], want [$(paste -sd';' <<<"$want")]"
		return 1
	fi
	CASE_DETAIL="$GDRDRV ($GDRDRV_MAJOR:0) beside uverbs of ${ids[*]}"
}
