package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// serve runs the plugin on upstream's device-plugin stub: it serves the
// socket, registers once, and registers again only when the kubelet restarts
// (a new kubelet.sock), which is what the stub's Watch does. A ListAndWatch
// stream the kubelet ends is not answered with a new Register: the AWS
// plugin's behaviour there is not public, and on kubelets up to 1.36 a second
// plugin's Register replaces the first without ending the first's stream, so
// no choice here changes what the cluster cases see (tests/e2e/README.md).
func serve(args []string) error {
	fs := flag.NewFlagSet("aws-standin", flag.ExitOnError)
	sysfs := fs.String("sysfs-root", "/sys", "where sysfs is mounted")
	dir := fs.String("device-plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin dir")
	parse(fs, args)

	efas, err := efaDevices(*sysfs)
	if err == nil && len(efas) == 0 {
		err = fmt.Errorf("none bound to efa under %s/class/infiniband", *sysfs)
	}
	if err != nil {
		// The AWS plugin's own line, its %v unformatted, then it exits.
		return fmt.Errorf("Error to get IB device: %%v. No valid EFA devices found: %w", err)
	}
	devs := make([]*pluginapi.Device, 0, len(efas))
	uverbs := make(map[string]string, len(efas))
	for _, d := range efas {
		klog.InfoS("device: " + d.ibdev + "," + d.uverbs + ",/sys/class/infiniband_verbs/" + d.uverbs + ",/sys/class/infiniband/" + d.ibdev)
		devs = append(devs, &pluginapi.Device{ID: d.ibdev, Health: pluginapi.Healthy})
		uverbs[d.ibdev] = d.uverbs
	}

	socket := filepath.Join(*dir, socketName)
	kubelet := filepath.Join(*dir, filepath.Base(pluginapi.KubeletSocket))
	// No PreStartContainer, no GetPreferredAllocation.
	stub := newStub(devs, socket, resourceName)
	stub.SetAllocFunc(func(r *pluginapi.AllocateRequest, _ map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
		return allocate(r, uverbs)
	})
	if err := start(stub); err != nil {
		return fmt.Errorf("serving %s: %w", socket, err)
	}
	if err := register(stub, kubelet, resourceName, *dir+"/"); err != nil {
		return fmt.Errorf("registering with %s: %w", kubelet, err)
	}
	klog.InfoS("Registered device plugin with Kubelet")
	go watch(stub, kubelet, resourceName, *dir+"/")

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
	return stop(stub)
}

// allocate answers one rw DeviceSpec per uverbs node, the container path the
// host path, and refuses IDs it does not advertise.
func allocate(r *pluginapi.AllocateRequest, uverbs map[string]string) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, req := range r.ContainerRequests {
		c := &pluginapi.ContainerAllocateResponse{}
		for _, id := range req.DevicesIds {
			node, ok := uverbs[id]
			if !ok {
				return nil, fmt.Errorf("unknown device %q", id)
			}
			path := "/dev/infiniband/" + node
			c.Devices = append(c.Devices, &pluginapi.DeviceSpec{HostPath: path, ContainerPath: path, Permissions: "rw"})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, c)
	}
	return resp, nil
}
