"""Validates CDI spec files against the upstream JSON schema: schema.json and the
defs.json it refers to, from the CDI Go module's schema/ dir.

Before the specs, it checks that the schema rejects a spec with a malformed
device, so a reference that failed to resolve cannot turn it into one that
accepts anything.

usage: schema_check.py SCHEMA_DIR SPEC.json...
Prints one line per spec: "ok PATH" or "not ok PATH: where: why".
"""

import copy
import json
import pathlib
import sys

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7


def load_validator(schema_dir):
    schema_dir = pathlib.Path(schema_dir)
    schema = json.loads((schema_dir / "schema.json").read_text(encoding="utf-8"))
    defs = json.loads((schema_dir / "defs.json").read_text(encoding="utf-8"))
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, registry=registry)


def problems(validator, spec):
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
        for e in sorted(validator.iter_errors(spec), key=lambda e: list(map(str, e.absolute_path)))
    ]


def schema_bites(validator, sample):
    """A copy of a real spec with a device node's major as text must be refused."""
    broken = copy.deepcopy(sample)
    broken["devices"][0]["containerEdits"]["deviceNodes"][0]["major"] = "231"
    return bool(problems(validator, broken))


def main(schema_dir, *paths):
    validator = load_validator(schema_dir)
    specs = {path: json.loads(pathlib.Path(path).read_text(encoding="utf-8")) for path in paths}
    if not specs or not schema_bites(validator, next(iter(specs.values()))):
        print("not ok schema: accepts a malformed device node, so it checks nothing")
        return 1
    failed = 0
    for path, spec in specs.items():
        found = problems(validator, spec)
        failed += bool(found)
        print(f"not ok {path}: {found[0]}" if found else f"ok {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
