// Command aws-standin behaves as the AWS EFA device plugin is documented to, so
// the cluster suite can migrate from it.
//
// usage:
//
//	aws-standin [--sysfs-root DIR] [--device-plugin-dir DIR]
//
// Which facts it mirrors, and where each comes from: tests/e2e/README.md.
package main

import (
	"flag"
	"fmt"
	"os"
)

// The resource and socket name the AWS plugin registers.
const (
	resourceName = "vpc.amazonaws.com/efa"
	socketName   = "aws-efa-device-plugin.sock"
)

func main() {
	if err := serve(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// parse parses args into fs, exiting 2 on a bad flag as the flag package does.
func parse(fs *flag.FlagSet, args []string) {
	fs.Init(fs.Name(), flag.ExitOnError)
	_ = fs.Parse(args)
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		os.Exit(2)
	}
}
