package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"
)

// efa is one EFA as DRANET describes it.
type efa struct {
	name, pciAddress, pcieRoot, uverbs string
	numaNode                           int64
}

// What DRANET's AWS chart filters EFAs by (dra.net/pciDevice).
const efaPCIDevice = "Elastic Fabric Adapter (EFA)"

// device is the ResourceSlice entry, with DRANET's attribute names. Those in the
// driver's own domain (dra.net) are written unqualified, the domain being implied:
// from 1.38 the kubeletplugin helper refuses them qualified
// (k8s.io/dynamic-resource-allocation resourceslice/validation.go,
// validateUnqualifiedName), and CEL's device.attributes["dra.net"] finds them either way.
func (e efa) device() resourceapi.Device {
	str := func(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: ptr.To(s)} }
	num := func(n int64) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{IntValue: ptr.To(n)} }
	return resourceapi.Device{
		Name: e.name,
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"pciAddress":                      str(e.pciAddress),
			"pciDevice":                       str(efaPCIDevice),
			"rdma":                            {BoolValue: ptr.To(true)},
			"rdmaDevice":                      str(e.name),
			"numaNode":                        num(e.numaNode),
			"resource.kubernetes.io/pcieRoot": str(e.pcieRoot),
			"resource.kubernetes.io/numaNode": num(e.numaNode),
		},
	}
}

// readEFAs describes each EFA bound to the efa driver under sysfs.
func readEFAs(sysfs string) ([]efa, error) {
	devs, err := efaDevices(sysfs)
	if err != nil {
		return nil, err
	}
	efas := make([]efa, 0, len(devs))
	for _, d := range devs {
		pci, err := filepath.EvalSymlinks(filepath.Join(sysfs, "class/infiniband", d.ibdev, "device"))
		if err != nil {
			return nil, err
		}
		e := efa{name: d.ibdev, pciAddress: filepath.Base(pci), pcieRoot: pcieRoot(sysfs, pci), uverbs: d.uverbs, numaNode: -1}
		if raw, err := os.ReadFile(filepath.Join(pci, "numa_node")); err == nil {
			if n, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64); err == nil {
				e.numaNode = n
			}
		}
		efas = append(efas, e)
	}
	return efas, nil
}

// pcieRoot is the root complex above the PCI function at pci, as the
// standard attribute names it: the first element under devices/ (pci0000:10).
func pcieRoot(sysfs, pci string) string {
	devices, err := filepath.EvalSymlinks(filepath.Join(sysfs, "devices"))
	if err != nil {
		return ""
	}
	rel, err := filepath.Rel(devices, pci)
	if err != nil {
		return ""
	}
	return strings.SplitN(rel, string(filepath.Separator), 2)[0]
}
