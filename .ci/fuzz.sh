#!/usr/bin/env bash
# Runs every cargo-fuzz target for a fixed time. cargo-fuzz is installed once, pinned, into a
# cache dir and reused. libFuzzer needs nightly-only compiler flags (-Zsanitizer); a stable
# toolchain accepts them with RUSTC_BOOTSTRAP=1, so no nightly toolchain is needed.
#
#   FUZZ_SECONDS  seconds per target (default 20)
#   FUZZ_TOOLS    where cargo-fuzz is cached (default $EFA_DP_TOOLS_CACHE/cargo-fuzz)
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
seconds=${FUZZ_SECONDS:-20}
tools=${FUZZ_TOOLS:-${EFA_DP_TOOLS_CACHE:-/var/cache/efa-device-plugin-tools}/cargo-fuzz}
repo=$(cd "$(dirname "$0")/.." && pwd)

if [[ "$("$tools/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" --root "$tools"
fi
export PATH="$tools/bin:$PATH"
export RUSTC_BOOTSTRAP=1

cd "$repo"
for target in $(cargo fuzz list); do
    echo "fuzz: $target for ${seconds}s"
    # What a run adds to the corpus stays out of the source tree; seeds, where any, are read.
    corpus=$(mktemp -d)
    seeds=()
    if [[ -d "fuzz/seeds/$target" ]]; then seeds=("fuzz/seeds/$target"); fi
    cargo fuzz run "$target" "$corpus" "${seeds[@]}" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
    rm -rf "$corpus"
done
