#!/usr/bin/env bash
# Unit tier: unit and property tests, and the integration tests that run the real binary against
# simulated nodes and the in-process kubelet stand-in. Needs no root and no network.
set -euo pipefail
cd "$(dirname "$0")/../.."

# --workspace: the plugin and the end-to-end runner (tests/e2e/runner), whose unit tests need no
# kubelet (its case table against docs/testing.md among them).
cargo test --locked --workspace
