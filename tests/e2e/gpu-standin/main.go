// Command gpu-standin is a second device plugin for the topology suite: a GPU resource whose
// devices sit on given NUMA nodes, so the kubelet's Topology Manager has a neighbour to align
// the EFAs with. It is the kubelet's own device-plugin stub
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1), so nothing of the plugin
// under test is in it. Allocate sets one environment variable naming the allocated IDs, which
// the suite reads back inside the container.
//
// The stub's calls changed in 1.35; tests/e2e/stubcompat/ adapts them and is built in.
//
// It registers once and serves until SIGTERM or SIGINT, then removes its socket. After a
// kubelet restart the suite starts it again.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func main() {
	dir := flag.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource to advertise")
	devices := flag.String("devices", "GPU-0@0,GPU-1@1", "comma-separated ID@NUMA (NUMA -1: no topology)")
	env := flag.String("env", "NVIDIA_VISIBLE_DEVICES", "the variable Allocate sets to the allocated IDs")
	flag.Parse()

	devs, err := parseDevices(*devices)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-standin: --devices: %v\n", err)
		os.Exit(2)
	}
	plugin := newStub(devs, filepath.Join(*dir, "gpu-standin.sock"), *resource)
	plugin.SetAllocFunc(func(r *pluginapi.AllocateRequest, known map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
		return allocate(r, known, *env)
	})
	if err := start(plugin); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-standin: serving: %v\n", err)
		os.Exit(1)
	}
	// The stub checks for a DEPRECATION file by plain concatenation, so the dir ends in a slash.
	if err := register(plugin, filepath.Join(*dir, filepath.Base(pluginapi.KubeletSocket)), *resource, *dir+"/"); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-standin: registering: %v\n", err)
		os.Exit(1)
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
	if err := stop(plugin); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-standin: stopping: %v\n", err)
		os.Exit(1)
	}
}

func parseDevices(list string) ([]*pluginapi.Device, error) {
	var devs []*pluginapi.Device
	for _, item := range strings.Split(list, ",") {
		id, numa, ok := strings.Cut(item, "@")
		node, err := strconv.ParseInt(numa, 10, 64)
		if !ok || id == "" || err != nil || node < -1 {
			return nil, fmt.Errorf("%q is not ID@NUMA", item)
		}
		dev := &pluginapi.Device{ID: id, Health: pluginapi.Healthy}
		if node >= 0 {
			dev.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: node}}}
		}
		devs = append(devs, dev)
	}
	return devs, nil
}

// allocate answers each container with the variable naming its IDs, in the order the kubelet
// sent them, and refuses IDs it never advertised, as a real plugin would.
func allocate(r *pluginapi.AllocateRequest, known map[string]*pluginapi.Device, env string) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range r.ContainerRequests {
		for _, id := range container.DevicesIds {
			if known[id] == nil {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{env: strings.Join(container.DevicesIds, ",")},
		})
	}
	return response, nil
}
