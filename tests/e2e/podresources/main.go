// podresources prints what the kubelet's PodResources List says every
// container holds of one resource: one line per container holding any,
// "namespace/pod/container id id ...", the IDs sorted. The soak
// (cluster/soak.sh) holds it against what is inside each container.
//
// With --repeat-for it lists nothing and instead calls List at --rate per
// second for that long, or until SIGTERM, then prints "lists N failed M". Each List makes the
// kubelet run UpdateAllocatedDevices, the trigger of kubernetes PR #137534;
// the admission burst (S2) calls it beside the plugin's own poll.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"
)

func main() {
	socket := flag.String("socket", "/var/lib/kubelet/pod-resources/kubelet.sock", "the kubelet's PodResources socket")
	resource := flag.String("resource", "vpc.amazonaws.com/efa", "the resource whose IDs to print")
	repeatFor := flag.Duration("repeat-for", 0, "call List for this long instead of printing one answer")
	rate := flag.Int("rate", 50, "List calls per second with --repeat-for (the kubelet allows 100 in all)")
	flag.Parse()
	var err error
	if *repeatFor > 0 {
		err = repeat(*socket, *repeatFor, *rate)
	} else {
		err = list(*socket, *resource)
	}
	if err != nil {
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

// repeat calls List rate times a second for d or until SIGTERM, on one connection.
func repeat(socket string, d time.Duration, rate int) error {
	if rate < 1 {
		return fmt.Errorf("--rate %d: must be at least 1", rate)
	}
	l, err := dialPodResources(socket)
	if err != nil {
		return err
	}
	defer l.close()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	lists, failed := 0, 0
	for ctx.Err() == nil {
		lists++
		if _, err := l.list(); err != nil {
			failed++
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
	fmt.Printf("lists %d failed %d\n", lists, failed)
	return nil
}
