#!/usr/bin/env bash
# Fuzz tier: every cargo-fuzz target (sysfs trees, the config file, Allocate and
# GetPreferredAllocation requests) for a short fixed time; see .ci/fuzz.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash .ci/fuzz.sh
