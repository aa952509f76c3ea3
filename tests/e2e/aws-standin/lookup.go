package main

import (
	"flag"
	"fmt"
	"slices"

	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// lookup does what the CloudWatch agent's Container Insights EFA receiver
// does: for each name under class/infiniband, it asks the kubelet's
// PodResources List which container holds a device with that ID under
// vpc.amazonaws.com/efa, and prints "name namespace/pod/container", or
// "name -" when no container does.
func lookup(args []string) error {
	fs := flag.NewFlagSet("aws-standin lookup", flag.ExitOnError)
	sysfs := fs.String("sysfs-root", "/sys", "where sysfs is mounted")
	socket := fs.String("pod-resources-socket", "/var/lib/kubelet/pod-resources/kubelet.sock", "the kubelet's PodResources socket")
	parse(fs, args)

	names, err := ibdevNames(*sysfs)
	if err != nil {
		return err
	}
	resp, err := listPodResources(*socket)
	if err != nil {
		return err
	}
	for _, name := range names {
		fmt.Println(name, holder(resp, name))
	}
	return nil
}

func holder(resp *podresources.ListPodResourcesResponse, id string) string {
	for _, pod := range resp.PodResources {
		for _, c := range pod.Containers {
			for _, d := range c.Devices {
				if d.ResourceName == resourceName && slices.Contains(d.DeviceIds, id) {
					return pod.Namespace + "/" + pod.Name + "/" + c.Name
				}
			}
		}
	}
	return "-"
}
