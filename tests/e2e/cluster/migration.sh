# shellcheck shell=bash
# The stand-in for the AWS plugin (tests/e2e/aws-standin: its socket,
# ibdev-name IDs, one rw DeviceSpec per uverbs node, no
# GetPreferredAllocation) and its chart, installed as the AWS chart installs
# it: what the runner's migration cases (runner/src/cluster/migration.rs) ask
# for, and F5 installs on late nodes; what fails prints why on stdout, which
# host_request replies with. Sourced by cluster.sh; the helpers are
# lib/cluster.sh's.

STANDIN_IMAGE=localhost/aws-efa-k8s-device-plugin:e2e
# Released as the AWS chart is.
STANDIN_RELEASE=aws-efa-k8s-device-plugin
STANDIN=

# standin_binary: the stand-in, built once per run for the cluster's version.
standin_binary() {
	[[ -n $STANDIN ]] && return 0
	local start=$SECONDS
	if ! STANDIN=$(stub_plugin "$CACHE" "$HERE/aws-standin" aws-standin "$HERE/efasysfs" 2>"$T/logs/aws-standin-build.log"); then
		STANDIN=
		echo "building the AWS plugin stand-in failed: $(tail -3 "$T/logs/aws-standin-build.log" | paste -sd'|')"
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
		echo "stand-in image build or import failed: $(tail -3 "$T/logs/buildah-standin.log" | paste -sd'|')"
		return 1
	fi
	mv "$T/images/aws-standin.tar.tmp" "$T/images/aws-standin.tar"
}

# standin_chart: the stand-in's chart installed as the AWS chart is, on every
# node whose containerd has its image (standin_image).
standin_chart() {
	helm install "$STANDIN_RELEASE" "$HERE/aws-standin/chart" -n "$NS" --set "sysfsHostPath=$FIXTURES/sys" >/dev/null && return 0
	echo "helm install of the stand-in failed"
	return 1
}

# standin_uninstall: the stand-in's release uninstalled, if there is one, and
# its pods gone.
standin_uninstall() {
	helm uninstall "$STANDIN_RELEASE" -n "$NS" --wait --ignore-not-found >/dev/null || { echo "helm uninstall of the stand-in failed"; return 1; }
	wait_until 60 no_standin_pod || { echo "stand-in pod still there 60s after helm uninstall"; return 1; }
}

no_standin_pod() { [[ -z $(kns get pods -l "name=$STANDIN_RELEASE" -o name 2>/dev/null) ]]; }
