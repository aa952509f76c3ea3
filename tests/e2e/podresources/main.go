// podresources prints what the kubelet's PodResources List says every
// container holds of one resource: one line per container holding any,
// "namespace/pod/container id id ...", the IDs sorted. The soak
// (cluster/soak.sh) holds it against what is inside each container.
package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
)

func main() {
	socket := flag.String("socket", "/var/lib/kubelet/pod-resources/kubelet.sock", "the kubelet's PodResources socket")
	resource := flag.String("resource", "vpc.amazonaws.com/efa", "the resource whose IDs to print")
	flag.Parse()
	if err := list(*socket, *resource); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func list(socket, resource string) error {
	resp, err := listPodResources(socket)
	if err != nil {
		return err
	}
	for _, pod := range resp.PodResources {
		for _, c := range pod.Containers {
			var ids []string
			for _, d := range c.Devices {
				if d.ResourceName == resource {
					ids = append(ids, d.DeviceIds...)
				}
			}
			if len(ids) > 0 {
				slices.Sort(ids)
				fmt.Printf("%s/%s/%s %s\n", pod.Namespace, pod.Name, c.Name, strings.Join(ids, " "))
			}
		}
	}
	return nil
}
