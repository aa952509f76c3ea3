// Command validate loads a CDI spec dir with the upstream library that containerd and
// CRI-O use, and fails unless it holds exactly the expected devices, each spec at the
// oldest version that has the features it uses, and every device injects into an OCI
// spec as a character device node.
//
// usage: validate SPEC_DIR EXPECTED_DEVICES_FILE
//
// The expected file lists one fully-qualified device name per line: the names the
// plugin answered Allocate with.
package main

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: validate SPEC_DIR EXPECTED_DEVICES_FILE")
		os.Exit(2)
	}
	devices, err := validate(os.Args[1], os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("%d devices resolve and inject\n", devices)
}

func validate(dir, expectedFile string) (int, error) {
	expected, err := readLines(expectedFile)
	if err != nil {
		return 0, err
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		return 0, fmt.Errorf("loading %s: %w", dir, err)
	}
	if errs := cache.GetErrors(); len(errs) > 0 {
		return 0, fmt.Errorf("spec errors: %v", errs)
	}

	listed := cache.ListDevices()
	slices.Sort(listed)
	want := slices.Clone(expected)
	slices.Sort(want)
	want = slices.Compact(want)
	if !slices.Equal(listed, want) {
		return 0, fmt.Errorf("devices differ: spec has %d, Allocate answered %d; first missing %q, first extra %q",
			len(listed), len(want), firstNotIn(want, listed), firstNotIn(listed, want))
	}

	specCount := 0
	for _, vendor := range cache.ListVendors() {
		for _, spec := range cache.GetVendorSpecs(vendor) {
			specCount++
			minimum, err := specs.MinimumRequiredVersion(spec.Spec)
			if err != nil {
				return 0, fmt.Errorf("%s: %w", spec.GetPath(), err)
			}
			if minimum != spec.Version {
				return 0, fmt.Errorf("%s: cdiVersion %s, but the oldest version with its features is %s",
					spec.GetPath(), spec.Version, minimum)
			}
		}
	}
	if specCount != 1 {
		return 0, fmt.Errorf("%s holds %d specs, want 1", dir, specCount)
	}

	for _, name := range want {
		ociSpec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		unresolved, err := cache.InjectDevices(ociSpec, name)
		if err != nil {
			return 0, fmt.Errorf("injecting %s: %w (unresolved %v)", name, err, unresolved)
		}
		if err := checkInjected(name, ociSpec); err != nil {
			return 0, err
		}
	}
	return len(want), nil
}

// checkInjected requires exactly one rw character device under /dev/infiniband, allowed
// in the device cgroup with the same numbers.
func checkInjected(name string, spec *oci.Spec) error {
	nodes := spec.Linux.Devices
	if len(nodes) != 1 {
		return fmt.Errorf("%s injects %d device nodes, want 1", name, len(nodes))
	}
	node := nodes[0]
	if spec.Linux.Resources == nil {
		return fmt.Errorf("%s adds no device cgroup rule", name)
	}
	if node.Type != "c" || !strings.HasPrefix(node.Path, "/dev/infiniband/uverbs") {
		return fmt.Errorf("%s injects %s of type %q, want a uverbs character device", name, node.Path, node.Type)
	}
	for _, rule := range spec.Linux.Resources.Devices {
		if rule.Allow && rule.Type == "c" && rule.Major != nil && *rule.Major == node.Major &&
			rule.Minor != nil && *rule.Minor == node.Minor && rule.Access == "rw" {
			return nil
		}
	}
	return fmt.Errorf("%s: no rw cgroup rule for %d:%d", name, node.Major, node.Minor)
}

func readLines(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var lines []string
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if line := strings.TrimSpace(scanner.Text()); line != "" {
			lines = append(lines, line)
		}
	}
	if len(lines) == 0 {
		return nil, fmt.Errorf("%s lists no device", path)
	}
	return lines, scanner.Err()
}

func firstNotIn(a, b []string) string {
	for _, s := range a {
		if _, found := slices.BinarySearch(b, s); !found {
			return s
		}
	}
	return ""
}
