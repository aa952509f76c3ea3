#!/usr/bin/env bash
# Deploy tier: the Dockerfile, the plain manifests, the Helm chart, the release workflows, and
# that they fit the binary they ship. See .ci/deploy-check.sh for its tools and cache.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash .ci/deploy-check.sh
