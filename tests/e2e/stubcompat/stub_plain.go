//go:build !stubctx

package main

// The stub's calls up to Kubernetes 1.34; see stub_ctx.go.

import (
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

func newStub(devs []*pluginapi.Device, socket, resource string) *v1beta1.Stub {
	return v1beta1.NewDevicePluginStub(devs, socket, resource, false, false)
}

func start(s *v1beta1.Stub) error { return s.Start() }

func register(s *v1beta1.Stub, kubelet, resource, dir string) error {
	return s.Register(kubelet, resource, dir)
}

func watch(s *v1beta1.Stub, kubelet, resource, dir string) { s.Watch(kubelet, resource, dir) }

func stop(s *v1beta1.Stub) error { return s.Stop() }
