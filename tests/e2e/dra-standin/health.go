//go:build drahealth

package main

import (
	"context"

	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

// WatchHealthStatus: DRANET reports no device health (dranet#293), and
// neither does the stand-in. The helper asks for it from 1.37 on;
// lib/build.sh sets the drahealth tag when it does.
func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
