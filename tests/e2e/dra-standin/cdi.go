package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// The CDI kind of the devices the stand-in prepares.
const cdiKind = "dra.net/efa"

// cdiDevice is one allocated EFA in a claim's spec: a name unique to the
// claim, so a runtime's cached spec of an earlier claim cannot match, and the
// uverbs node the container gets.
type cdiDevice struct {
	name, node string
}

func (d cdiDevice) String() string { return d.name + "=" + d.node }

// cdiSpecs writes one spec file per prepared claim.
type cdiSpecs struct {
	dir string
}

func (c cdiSpecs) path(claimUID string) string {
	return filepath.Join(c.dir, "dra.net-efa-"+claimUID+".json")
}

// write puts the claim's spec in place through a rename, so the runtime never
// reads half of it.
func (c cdiSpecs) write(claimUID string, devices []cdiDevice) error {
	type node struct {
		Path string `json:"path"`
	}
	type device struct {
		Name           string `json:"name"`
		ContainerEdits struct {
			DeviceNodes []node `json:"deviceNodes"`
		} `json:"containerEdits"`
	}
	spec := struct {
		CDIVersion string   `json:"cdiVersion"`
		Kind       string   `json:"kind"`
		Devices    []device `json:"devices"`
	}{CDIVersion: "0.6.0", Kind: cdiKind}
	for _, d := range devices {
		var entry device
		entry.Name = d.name
		entry.ContainerEdits.DeviceNodes = []node{{Path: d.node}}
		spec.Devices = append(spec.Devices, entry)
	}
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return err
	}
	tmp := c.path(claimUID) + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("writing the CDI spec: %w", err)
	}
	return os.Rename(tmp, c.path(claimUID))
}

// remove deletes the claim's spec; a claim never prepared here has none.
func (c cdiSpecs) remove(claimUID string) error {
	if err := os.Remove(c.path(claimUID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
