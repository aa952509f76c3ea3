// Command dra-standin is a DRA driver registered as DRANET registers
// (driver dra.net, through the kubeletplugin helper) that publishes the
// node's EFAs with DRANET's attribute names and prepares a claim by writing a
// CDI spec for the allocated EFAs' uverbs nodes. The cluster suite hands a
// node from the device plugin to it and back.
//
// usage:
//
//	dra-standin [--sysfs-root DIR] [--cdi-dir DIR] --node-name NAME
//
// What of DRANET it mirrors and what it leaves out: tests/e2e/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// DRANET's driver name, which the device plugin's DRA guard looks for.
const driverName = "dra.net"

func main() {
	fs := flag.NewFlagSet("dra-standin", flag.ExitOnError)
	sysfs := fs.String("sysfs-root", "/sys", "sysfs to read the EFAs from")
	cdiDir := fs.String("cdi-dir", "/var/run/cdi", "where the runtime reads CDI specs")
	node := fs.String("node-name", os.Getenv("NODE_NAME"), "this node (default $NODE_NAME)")
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() > 0 || *node == "" {
		fmt.Fprintln(os.Stderr, "dra-standin: --node-name (or NODE_NAME) is required and no arguments are taken")
		os.Exit(2)
	}
	if err := serve(*sysfs, *cdiDir, *node); err != nil {
		fmt.Fprintln(os.Stderr, "dra-standin:", err)
		os.Exit(1)
	}
}

func serve(sysfs, cdiDir, node string) error {
	efas, err := readEFAs(sysfs)
	if err != nil {
		return fmt.Errorf("reading the EFAs under %s: %w", sysfs, err)
	}
	config, err := rest.InClusterConfig()
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	driver := &driver{efas: map[string]efa{}, cdi: cdiSpecs{dir: cdiDir}, cancel: stop}
	devices := make([]resourceapi.Device, 0, len(efas))
	for _, e := range efas {
		driver.efas[e.name] = e
		devices = append(devices, e.device())
	}
	// The helper serves its DRA socket there but does not make the dir.
	if err := os.MkdirAll(filepath.Join(kubeletplugin.KubeletPluginsDir, driverName), 0o750); err != nil {
		return err
	}
	helper, err := kubeletplugin.Start(ctx, driver,
		kubeletplugin.DriverName(driverName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(node))
	if err != nil {
		return fmt.Errorf("registering with the kubelet: %w", err)
	}
	defer helper.Stop()
	resources := resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{node: {Slices: []resourceslice.Slice{{Devices: devices}}}},
	}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return fmt.Errorf("publishing the ResourceSlice: %w", err)
	}
	fmt.Printf("registered as %s on %s, publishing %d EFAs\n", driverName, node, len(devices))
	<-ctx.Done()
	return nil
}

// driver prepares claims for the EFAs it published.
type driver struct {
	efas   map[string]efa
	cdi    cdiSpecs
	cancel func()
}

func (d *driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		result[claim.UID] = d.prepare(claim)
	}
	return result, nil
}

func (d *driver) prepare(claim *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	var prepared []kubeletplugin.Device
	var nodes []cdiDevice
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != driverName {
			continue
		}
		e, ok := d.efas[r.Device]
		if !ok {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s: device %s is not an EFA of this node", claim.Name, r.Device)}
		}
		dev := cdiDevice{name: string(claim.UID) + "-" + e.name, node: "/dev/infiniband/" + e.uverbs}
		nodes = append(nodes, dev)
		prepared = append(prepared, kubeletplugin.Device{
			Requests:     []string{r.Request},
			PoolName:     r.Pool,
			DeviceName:   r.Device,
			CDIDeviceIDs: []string{cdiKind + "=" + dev.name},
		})
	}
	if err := d.cdi.write(string(claim.UID), nodes); err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	fmt.Printf("prepared claim %s/%s (%s): %v\n", claim.Namespace, claim.Name, claim.UID, nodes)
	return kubeletplugin.PrepareResult{Devices: prepared}
}

func (d *driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		result[claim.UID] = d.cdi.remove(string(claim.UID))
		fmt.Printf("unprepared claim %s (%s)\n", claim.NamespacedName, claim.UID)
	}
	return result, nil
}

// HandleError ends the driver on an error retrying cannot fix, as the helper asks.
func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	runtime.HandleErrorWithContext(ctx, err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		d.cancel()
	}
}
