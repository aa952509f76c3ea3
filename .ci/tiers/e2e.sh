#!/usr/bin/env bash
# End-to-end tier: the CDI specs the plugin writes against the upstream schema and Go library,
# the release binary against a real kubelet and containerd, the same kubelet's NUMA alignment on
# a host it sees as two NUMA nodes, then the image, manifests and chart
# on a real single-node cluster. Needs root; each suite changes the host
# only while it runs and restores it, and takes a host-wide lock, so two runs never overlap.
# Their caches: EFA_DP_E2E_CACHE, EFA_DP_E2E_KUBE_VERSION (see tests/e2e/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."

bash tests/cdi/validate.sh
bash tests/e2e/kubelet.sh
bash tests/e2e/topology.sh
bash tests/e2e/cluster.sh
