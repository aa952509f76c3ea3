#!/usr/bin/env bash
# Unit tier: unit and property tests, and the integration tests that run the real binary against
# simulated nodes and the in-process kubelet stand-in. Needs no root and no network.
set -euo pipefail
cd "$(dirname "$0")/../.."

cargo test --locked
