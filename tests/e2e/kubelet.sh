#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End-to-end test of efa-device-plugin against a real kubelet and containerd
# on this host. The EFAs are a fake p4d-shaped sysfs tree plus real character
# device nodes, so everything from discovery to the container's /dev is real
# except the hardware behind the nodes.
#
# Needs root. Prints one line per case and "N passed, M failed" last; exits
# non-zero on any failure. Leaves the host as it found it, also on failure.
#
# Environment:
#   EFA_DP_E2E_CACHE         where the kubelet build and its Go caches live
#                            (default /var/cache/efa-device-plugin-e2e)
#   EFA_DP_E2E_KUBE_VERSION  kubelet version to build (default in lib/build.sh)
#   EFA_DP_E2E_CASES         a regex: only the cases whose label matches run
#
# This script brings the host up (containerd, the kubelet's config, the
# binaries) and puts it back; the cases, their fixtures (the fake EFAs, the
# kubelet's and the plugin's processes, the static pods) and their checks are
# the runner's (tests/e2e/runner), which prints the case lines.
set -uo pipefail

# shellcheck source=SCRIPTDIR/lib/suite.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/suite.sh"
source "$HERE/lib/standalone.sh"

SUITE=kubelet

# ---------------------------------------------------------------- setup

setup() {
	prepare_standalone
	start_standalone
}

# ---------------------------------------------------------------- cases

kubelet_cases() { run_runner kubelet; }

cleanup() { stop_standalone; }

run_suite kubelet_cases
