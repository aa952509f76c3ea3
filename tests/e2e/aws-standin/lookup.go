package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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
	conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := podresources.NewPodResourcesListerClient(conn).List(ctx, &podresources.ListPodResourcesRequest{})
	if err != nil {
		return fmt.Errorf("PodResources List on %s: %w", *socket, err)
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
