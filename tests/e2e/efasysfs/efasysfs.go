// The EFAs of a sysfs tree as the stand-ins find them; built into each
// stand-in beside its own sources (lib/build.sh).
package main

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// ibdevNames lists the names under <sysfs>/class/infiniband, sorted.
func ibdevNames(sysfs string) ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(sysfs, "class/infiniband"))
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names, nil
}

// efaDevice is one EFA by its ibdev name (the AWS plugin's device ID, and
// the name DRANET publishes) and its uverbs node.
type efaDevice struct {
	ibdev, uverbs string
}

// efaDevices pairs each ibdev bound to the efa driver with its uverbs node
// through class/infiniband_verbs/*/ibdev, as the AWS plugin's log lines show,
// sorted by ibdev.
func efaDevices(sysfs string) ([]efaDevice, error) {
	names, err := ibdevNames(sysfs)
	if err != nil {
		return nil, err
	}
	uverbsOf, err := uverbsByIbdev(sysfs)
	if err != nil {
		return nil, err
	}
	var devs []efaDevice
	for _, name := range names {
		driver, err := os.Readlink(filepath.Join(sysfs, "class/infiniband", name, "device/driver"))
		if err != nil || filepath.Base(driver) != "efa" {
			continue
		}
		if uverbs, ok := uverbsOf[name]; ok {
			devs = append(devs, efaDevice{ibdev: name, uverbs: uverbs})
		}
	}
	return devs, nil
}

func uverbsByIbdev(sysfs string) (map[string]string, error) {
	dir := filepath.Join(sysfs, "class/infiniband_verbs")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for _, e := range entries {
		ibdev, err := os.ReadFile(filepath.Join(dir, e.Name(), "ibdev"))
		if err == nil {
			m[strings.TrimSpace(string(ibdev))] = e.Name()
		}
	}
	return m, nil
}
