"""The Dockerfile as the one definition of how the plugin is built and packaged.

  dockerfile.py build-env DOCKERFILE
      prints the ENV of the stage named "build", NAME=VALUE a line, so a build
      outside the image uses exactly the image's compiler settings.
  dockerfile.py check-image DOCKERFILE ARCHIVE NAME ARCH=BINARY... [--build-arg K=V]...
      checks the oci-archive ARCHIVE, whose index names NAME, against the
      Dockerfile's final stage for each ARCH (amd64, arm64): one image per
      architecture with that architecture and os linux, the stage's labels,
      user, entrypoint and cmd, and exactly the files its COPY puts there, the
      copied one byte for byte BINARY.
"""

import hashlib
import json
import shlex
import stat
import sys
import tarfile


def instructions(path):
    """(KEYWORD, ARGUMENTS) per instruction, continuation lines joined."""
    out, pending = [], ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if pending and line.lstrip().startswith("#"):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = pending + line
            pending = ""
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def stages(path):
    """The stages in order: (name or None, [instructions]), plus the global ARGs."""
    global_args, result = {}, []
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            words = rest.split()
            name = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else None
            result.append((name, []))
        elif result:
            result[-1][1].append((keyword, rest))
        elif keyword == "ARG":
            key, _, value = rest.partition("=")
            global_args[key] = value
    return global_args, result


def pairs(rest):
    """KEY=VALUE words of an ENV or LABEL instruction, quotes removed."""
    out = {}
    for word in shlex.split(rest):
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"not KEY=VALUE: {word!r} in {rest!r}")
        out[key] = value
    return out


def expand(value, args):
    for key, arg in args.items():
        value = value.replace("${" + key + "}", arg).replace("$" + key, arg)
    return value


def stage(path, name):
    for stage_name, body in stages(path)[1]:
        if stage_name == name:
            return body
    raise SystemExit(f"{path}: no stage named {name!r}")


def build_env(path):
    for keyword, rest in stage(path, "build"):
        if keyword == "ENV":
            for key, value in pairs(rest).items():
                print(f"{key}={value}")


def final_stage(path, build_args):
    """What the final stage gives an image: labels, user, entrypoint, cmd, and
    the files its COPY --from=build lines put there (destination -> source)."""
    body = stages(path)[1][-1][1]
    args, want = {}, {"labels": {}, "user": "", "entrypoint": None, "cmd": None, "copies": {}}
    for keyword, rest in body:
        if keyword == "ARG":
            key, _, default = rest.partition("=")
            args[key] = build_args.get(key, default)
        elif keyword == "LABEL":
            want["labels"].update({k: expand(v, args) for k, v in pairs(rest).items()})
        elif keyword == "USER":
            want["user"] = expand(rest, args)
        elif keyword in ("ENTRYPOINT", "CMD"):
            want[keyword.lower()] = json.loads(rest)
        elif keyword == "COPY":
            words = shlex.split(rest)
            if words[0] != "--from=build" or len(words) != 3:
                raise SystemExit(f"{path}: the final stage's COPY is not one file from the build stage: {rest}")
            want["copies"][words[2].lstrip("/")] = words[1]
        else:
            raise SystemExit(f"{path}: the check does not know what {keyword} in the final stage gives the image")
    return want


class Archive:
    def __init__(self, path):
        self.tar = tarfile.open(path)

    def json(self, name):
        return json.load(self.tar.extractfile(name))

    def blob(self, digest):
        return self.tar.extractfile("blobs/sha256/" + digest.split(":", 1)[1])

    def manifests(self, name):
        """(platform, manifest) of every image the index entry NAME leads to."""
        index = self.json("index.json")
        entries = [m for m in index["manifests"]
                   if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == name]
        if len(entries) != 1:
            raise SystemExit(f"index.json has {len(entries)} entries named {name}: {index['manifests']}")
        return list(self.walk(entries[0]))

    def walk(self, desc):
        doc = json.load(self.blob(desc["digest"]))
        if "manifests" in doc:
            for child in doc["manifests"]:
                yield from self.walk(child)
        else:
            yield desc.get("platform"), doc


def files(archive, manifest):
    """path -> (mode, sha256) of the regular files of the image's layers; other entries' paths."""
    regular, other = {}, []
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=archive.blob(layer["digest"]), mode="r:*") as tar:
            for member in tar:
                path = member.name.lstrip("./")
                if not path:
                    continue
                if member.isfile():
                    data = tar.extractfile(member).read()
                    regular[path] = (stat.S_IMODE(member.mode), hashlib.sha256(data).hexdigest())
                else:
                    other.append(path)
    return regular, other


def own_labels(labels):
    """The labels without the one buildah stamps on whatever it builds."""
    return {k: v for k, v in labels.items() if k != "io.buildah.version"}


def check_image(dockerfile, archive_path, name, rest):
    binaries, build_args, problems = {}, {}, []
    words = iter(rest)
    for word in words:
        if word == "--build-arg":
            key, _, value = next(words).partition("=")
            build_args[key] = value
        else:
            arch, _, binary = word.partition("=")
            binaries[arch] = binary
    want = final_stage(dockerfile, build_args)
    archive = Archive(archive_path)
    seen = {}
    for platform, manifest in archive.manifests(name):
        config = json.load(archive.blob(manifest["config"]["digest"]))
        arch = config.get("architecture")
        if arch in seen:
            problems.append(f"two images for {arch}")
        seen[arch] = True
        if arch not in binaries:
            problems.append(f"an image for {arch}, which was not asked for")
            continue
        if platform is not None and (platform.get("architecture"), platform.get("os")) != (arch, config.get("os")):
            problems.append(f"{arch}: the index says {platform}, the config {arch}/{config.get('os')}")
        got = config.get("config", {})
        checks = [
            ("os", config.get("os"), "linux"),
            ("user", got.get("User", ""), want["user"]),
            ("entrypoint", got.get("Entrypoint"), want["entrypoint"]),
            ("cmd", got.get("Cmd"), want["cmd"]),
            ("labels", own_labels(got.get("Labels") or {}), want["labels"]),
        ]
        with open(binaries[arch], "rb") as f:
            binary = hashlib.sha256(f.read()).hexdigest()
        regular, other = files(archive, manifest)
        want_files = {dst: (0o755, binary) for dst in want["copies"]}
        checks.append(("files", regular, want_files))
        checks.append(("other entries", other, []))
        for what, value, expected in checks:
            if isinstance(value, dict) and value != expected:
                differ = sorted(k for k in value.keys() | expected.keys() if value.get(k) != expected.get(k))
                value = {k: value.get(k) for k in differ}
                expected = {k: expected.get(k) for k in differ}
            if value != expected:
                problems.append(f"{arch}: {what} is {value!r}, the Dockerfile gives {expected!r}")
    for arch in binaries:
        if arch not in seen:
            problems.append(f"no image for {arch}")
    if problems:
        raise SystemExit("\n".join(problems))
    print(f"{name}: {', '.join(sorted(seen))} match the Dockerfile's final stage")


def main():
    command, dockerfile, *rest = sys.argv[1:]
    if command == "build-env":
        build_env(dockerfile)
    elif command == "check-image":
        check_image(dockerfile, rest[0], rest[1], rest[2:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
