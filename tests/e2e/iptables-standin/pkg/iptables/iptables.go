// Package iptables stands in for sigs.k8s.io/iptables-wrappers/pkg/iptables in the end-to-end
// suites' Kubernetes builds, which take k8s.io/kubernetes through the Go module proxy. From 1.38
// the kubelet imports that package (pkg/kubelet/kubelet_network_linux.go), and the proxy serves
// only the module's go.mod, not its source, so the build cannot get it. tests/e2e/lib/build.sh
// (kube_gomod) points the module at this directory with a replace directive, in its scratch build
// module only, when the Kubernetes version requires the module and the proxy refuses its source.
//
// It is written from the calls the kubelet makes and holds just what they compile against. It
// behaves as on a host without iptables: NewBestEffort finds no client, so the kubelet logs "No
// iptables support on this system" and creates no chains. The kubelet reaches that call only when
// its config sets makeIPTablesUtilChains, which every suite's config turns off, so a suite's
// kubelet never calls into this package. kube-proxy uses more of the real package and does not
// build against this one; the suites do not build it.
package iptables

import (
	"context"
	"time"
)

// Protocol is the IP family a client works on.
type Protocol string

const (
	ProtocolIPv4 Protocol = "IPv4"
	ProtocolIPv6 Protocol = "IPv6"
)

// Table names an iptables table.
type Table string

const (
	TableNAT    Table = "nat"
	TableFilter Table = "filter"
	TableMangle Table = "mangle"
)

// Chain names an iptables chain.
type Chain string

const (
	ChainInput  Chain = "INPUT"
	ChainOutput Chain = "OUTPUT"
)

// RulePosition says where EnsureRule puts a missing rule in its chain.
type RulePosition string

const (
	Prepend RulePosition = "-I"
	Append  RulePosition = "-A"
)

// Mode says how NewBestEffort picks between iptables-legacy and iptables-nft.
type Mode int

const (
	// DetectHostMode: the one the host's rules already use.
	DetectHostMode Mode = iota
	// UseInstalledMode: the one the installed iptables binary uses.
	UseInstalledMode
)

// Interface is one iptables client, for one IP family.
type Interface interface {
	// EnsureChain creates the chain unless it exists, and reports whether it existed.
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	// EnsureRule adds the rule unless it exists, and reports whether it existed.
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	// IsIPv6 reports whether the client works on IPv6.
	IsIPv6() bool
	// Protocol is the client's IP family.
	Protocol() Protocol
	// Monitor calls reload whenever the canary chain goes missing from any of the tables,
	// checking every interval until ctx is done.
	Monitor(ctx context.Context, canary Chain, tables []Table, reload func(), interval time.Duration)
}

// NewBestEffort returns a client for each IP family the host's iptables supports. A host
// without iptables has none, and that is what every host looks like through this package.
func NewBestEffort(ctx context.Context, mode Mode) map[Protocol]Interface {
	return map[Protocol]Interface{}
}
