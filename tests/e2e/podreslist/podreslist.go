// The kubelet's PodResources List, as the programs that read it here ask for
// it; built into each beside its own sources (lib/build.sh stub_plugin).
package main

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// listPodResources asks the kubelet on socket for every pod's resources,
// within 10 s.
func listPodResources(socket string) (*podresources.ListPodResourcesResponse, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := podresources.NewPodResourcesListerClient(conn).List(ctx, &podresources.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("PodResources List on %s: %w", socket, err)
	}
	return resp, nil
}
