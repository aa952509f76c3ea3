# shellcheck shell=bash
# The DRA driver stand-in (tests/e2e/dra-standin, registered as DRANET's
# dra.net) for the DRA cases, which the runner holds
# (tests/e2e/runner/src/cluster/dra.rs): its image, built once a run, and its
# DaemonSet, applied and deleted on the runner's request; what fails prints
# why on stdout, which host_request replies with. Sourced by cluster.sh; the
# helpers are lib/cluster.sh's.

DRA_IMAGE=localhost/dra-standin:e2e

# dra_standin_image: the stand-in's FROM scratch image, built and imported
# once per run.
dra_standin_image() {
	local ctx=$T/dra-standin-context start=$SECONDS standin
	[[ -f $T/images/dra-standin.tar ]] && return 0
	if ! standin=$(dra_driver "$CACHE" "$HERE/dra-standin" dra-standin "$HERE/efasysfs" 2>"$T/logs/dra-standin-build.log"); then
		echo "building the DRA driver stand-in failed: $(tail -3 "$T/logs/dra-standin-build.log" | paste -sd'|')"
		return 1
	fi
	mkdir -p "$ctx" && cp "$standin" "$ctx/dra-standin" || return 1
	if ! oci_archive "$T/buildah" "$DRA_IMAGE" "$T/images/dra-standin.tar.tmp" \
		-f "$HERE/dra-standin/Containerfile" "$ctx" >"$T/logs/buildah-dra-standin.log" 2>&1 ||
		! ctr_k8s images import "$T/images/dra-standin.tar.tmp" >>"$T/logs/buildah-dra-standin.log" 2>&1; then
		echo "DRA stand-in image build or import failed: $(tail -3 "$T/logs/buildah-dra-standin.log" | paste -sd'|')"
		return 1
	fi
	mv "$T/images/dra-standin.tar.tmp" "$T/images/dra-standin.tar"
	note "DRA driver stand-in image ready in $((SECONDS - start))s"
}

dra_manifest() {
	sed -e "s#SYSFS_HOST_PATH#$FIXTURES/sys#" -e "s#\"APISERVER_PORT\"#\"$APISERVER_PORT\"#" "$HERE/dra-standin/daemonset.yaml"
}

# dra_standin_up: the image there and the DaemonSet applied.
dra_standin_up() {
	dra_standin_image || return 1
	dra_manifest | k apply -f - >/dev/null || { echo "the API server rejected the stand-in's manifest"; return 1; }
}

dra_standin_down() {
	dra_manifest | k delete -f - --ignore-not-found --wait >/dev/null || { echo "deleting the stand-in's manifest failed"; return 1; }
}
