"""Writes a one-layer OCI image archive from the static busybox binary.

There is no registry to pull from, so the e2e builds its workload image and
its pod sandbox ("pause") image locally and imports them into containerd.
Usage: oci-image.py BUSYBOX NAME OUT.tar [CMD...]
"""

import hashlib
import io
import json
import subprocess
import sys
import tarfile


def add_file(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    tar.addfile(info)


def layer(busybox):
    with open(busybox, "rb") as f:
        binary = f.read()
    applets = subprocess.run(
        [busybox, "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            add_dir(tar, d)
        add_file(tar, "bin/busybox", binary, 0o755)
        for applet in applets:
            if applet == "busybox":
                continue
            info = tarfile.TarInfo("bin/" + applet)
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
        add_file(tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\n")
        add_file(tar, "etc/group", b"root:x:0:\n")
    return buf.getvalue()


def blob(tar, data, media_type):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    add_file(tar, "blobs/sha256/" + digest[len("sha256:"):], data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def main():
    busybox, name, out, *cmd = sys.argv[1:]
    layer_data = layer(busybox)
    with tarfile.open(out, "w") as tar:
        layer_desc = blob(tar, layer_data, "application/vnd.oci.image.layer.v1.tar")
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd or ["sh"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = blob(
            tar,
            json.dumps(config).encode(),
            "application/vnd.oci.image.config.v1+json",
        )
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        manifest_desc = blob(
            tar,
            json.dumps(manifest).encode(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        manifest_desc["annotations"] = {"io.containerd.image.name": name}
        manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
        index = {"schemaVersion": 2, "manifests": [manifest_desc]}
        add_file(tar, "index.json", json.dumps(index).encode())
        add_file(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())


if __name__ == "__main__":
    main()
