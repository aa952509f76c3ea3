// A stand-in for the AWS EFA device plugin, for the cluster suite. Its one
// dependency, k8s.io/kubernetes (upstream's device-plugin stub), is required at
// build time at the cluster's version: tests/e2e/lib/build.sh aws_standin_binary
// writes the require and staging replace lines, so this file names the module only.
module efa-device-plugin/tests/e2e/aws-standin

go 1.24
