//go:build stubctx

package main

// The stub's calls from Kubernetes 1.35 on, which take a context or a logger.
// Both stand-ins are built with these files copied in (tests/e2e/lib/build.sh
// stub_plugin), which picks this file or stub_plain.go by the signature it
// finds in the stub's source.

import (
	"context"

	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

func newStub(devs []*pluginapi.Device, socket, resource string) *v1beta1.Stub {
	return v1beta1.NewDevicePluginStub(klog.Background(), devs, socket, resource, false, false)
}

func start(s *v1beta1.Stub) error { return s.Start(context.Background()) }

func register(s *v1beta1.Stub, kubelet, resource, dir string) error {
	return s.Register(context.Background(), kubelet, resource, dir)
}

func watch(s *v1beta1.Stub, kubelet, resource, dir string) {
	s.Watch(context.Background(), kubelet, resource, dir)
}

func stop(s *v1beta1.Stub) error { return s.Stop(klog.Background()) }
