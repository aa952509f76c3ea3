module sigs.k8s.io/iptables-wrappers

go 1.22.0
