// The kubelet's PodResources List, as podresources/ asks for it; built into it
// beside its own sources (lib/build.sh stub_plugin).
package main

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// podResourcesLister is one connection to the kubelet's PodResources socket.
type podResourcesLister struct {
	socket string
	conn   *grpc.ClientConn
	client podresources.PodResourcesListerClient
}

func dialPodResources(socket string) (*podResourcesLister, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	return &podResourcesLister{socket, conn, podresources.NewPodResourcesListerClient(conn)}, nil
}

// list asks the kubelet for every pod's resources, within 10 s.
func (l *podResourcesLister) list() (*podresources.ListPodResourcesResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := l.client.List(ctx, &podresources.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("PodResources List on %s: %w", l.socket, err)
	}
	return resp, nil
}

func (l *podResourcesLister) close() { l.conn.Close() }

// listPodResources asks the kubelet on socket for every pod's resources once.
func listPodResources(socket string) (*podresources.ListPodResourcesResponse, error) {
	l, err := dialPodResources(socket)
	if err != nil {
		return nil, err
	}
	defer l.close()
	return l.list()
}
