# shellcheck shell=bash
# A fleet on this host: beside efa-a (p4d, 4 EFAs, the single-node cases'
# node) the nodes efa-b (p5en, 16 EFAs with other names) and plain (no EFA),
# each in namespaces of its own (lib/nodes.sh), all registered with the one
# control plane, and the late nodes that join and go. The cases, what users
# live through on fleets, are the typed runner's
# (tests/e2e/runner/src/cluster/fleet/): it asks for the fleet, the chart, a
# late node and the AWS plugin's stand-in through cluster.sh's host_request.
#
# Sourced by cluster.sh; besides lib/cluster.sh's helpers it uses
# migration.sh's stand-in. The fleet comes up with the runner's first chart
# request and stays up to the end of the run, so the single-node cases, which
# run before, see efa-a alone. What fails prints why on stdout, as
# lib/cluster.sh's installs do.

FLEET_B=efa-b
FLEET_PLAIN=plain
# shellcheck disable=SC2153 # NODE is cluster.sh's
declare -A NODE_SHAPE=([$NODE]=p4d [$FLEET_B]=p5en [$FLEET_PLAIN]=none)
declare -A FLEET_SLOT=([$FLEET_B]=1 [$FLEET_PLAIN]=2)

# make_node_fixtures NODE (for add_node): the sysfs tree of NODE's shape, and
# the uverbs nodes its EFAs have.
make_node_fixtures() {
	local home
	home=$(node_home "$1")
	mkdir -p "$home/fixtures/sys/class" "$home/dev/infiniband" || return 1
	case ${NODE_SHAPE[$1]} in
	p4d | p5en) fake_host "${NODE_SHAPE[$1]}" "$home/fixtures/sys" "$home/dev" ;;
	none) ;;
	esac
}

# ensure_fleet: efa-b and plain up and Ready, started once per run.
ensure_fleet() {
	local node
	for node in "$FLEET_B" "$FLEET_PLAIN"; do
		if [[ -z ${NODE_HOLDER[$node]:-} ]]; then
			add_node "$node" "${FLEET_SLOT[$node]}" || return 1
		elif ! node_ready "$node"; then
			echo "fleet node $node is not Ready"
			return 1
		fi
	done
}

# fleet_chart [HELM_ARGS...]: the fleet up, no pod left in default, and the
# chart installed anew with the suite's values and HELM_ARGS.
# shellcheck disable=SC2120 # the runner's chart request passes HELM_ARGS (cluster.sh's host_request)
fleet_chart() {
	ensure_fleet || return 1
	uninstall_plugin || return 1
	k delete pods,deployments,jobs --all -n default --wait >/dev/null 2>&1
	ours_install "$@"
}

# install_labelled_kustomize: the plugin anew from the labelled overlay, on
# the fleet (the runner's F2 asks for it).
install_labelled_kustomize() {
	ensure_fleet && uninstall_plugin || return 1
	k apply -k "$HERE/cluster/kustomize/labelled" >/dev/null && return 0
	echo "kubectl apply -k rejected the labelled overlay"
	return 1
}

# join_node NODE: NODE, a p4d, joins in the slot after the fleet's and is Ready
# (the runner's F5); it stays until remove_node.
join_node() {
	NODE_SHAPE[$1]=p4d
	add_node "$1" 3
}

# fleet_standin: the AWS plugin's stand-in in this plugin's place, installed as
# the AWS chart installs it, on every node of the fleet and on each node that
# joins until fleet_standin_uninstall (the runner's F5).
fleet_standin() {
	local node
	uninstall_plugin && standin_image || return 1
	IMAGES_FOR_NODES+=("$T/images/aws-standin.tar")
	for node in "$FLEET_B" "$FLEET_PLAIN"; do
		ctr_on "$node" images import "$T/images/aws-standin.tar" >/dev/null 2>&1 ||
			{ echo "cannot import the stand-in image on $node"; return 1; }
	done
	standin_chart
}

# fleet_standin_uninstall: the stand-in gone, and its image no longer given to
# nodes that start.
fleet_standin_uninstall() {
	local image kept=()
	for image in "${IMAGES_FOR_NODES[@]}"; do
		[[ $image == "$T/images/aws-standin.tar" ]] || kept+=("$image")
	done
	IMAGES_FOR_NODES=("${kept[@]}")
	standin_uninstall
}

