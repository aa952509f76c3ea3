"""Checks a release binary's ELF headers: what the kernel needs to run it on a
node whatever its userland and page size.

Usage: elf_check.py BINARY MACHINE MIN_ALIGN
  MACHINE    x86_64 or aarch64: the ELF e_machine it must have
  MIN_ALIGN  every PT_LOAD segment's p_align must be at least this many bytes
             (65536 for arm64, whose kernels may use 64 KiB pages, as on
             Ubuntu's for Grace: a segment aligned to less cannot be mapped)

The binary must be a 64-bit little-endian executable (ET_EXEC, or ET_DYN as a
static-pie), without PT_INTERP (no dynamic loader) and without DT_NEEDED (no
shared library). Read from the headers directly, so the check needs no
binutils for a foreign architecture.
"""

import struct
import sys

MACHINES = {"x86_64": 62, "aarch64": 183}
ET_EXEC, ET_DYN = 2, 3
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NULL, DT_NEEDED = 0, 1


def program_headers(data):
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"not 64-bit little-endian (EI_CLASS {data[4]}, EI_DATA {data[5]})")
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    e_phoff, = struct.unpack_from("<Q", data, 32)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 54)
    headers = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, p_align = struct.unpack_from(
            "<IIQQQQQQ", data, e_phoff + i * e_phentsize
        )
        headers.append({"type": p_type, "offset": p_offset, "vaddr": p_vaddr, "filesz": p_filesz, "align": p_align})
    return e_type, e_machine, headers


def needed(data, headers):
    """The DT_NEEDED count of the dynamic section, if any (a static-pie has one, for its relocations)."""
    count = 0
    for h in headers:
        if h["type"] != PT_DYNAMIC:
            continue
        for off in range(h["offset"], h["offset"] + h["filesz"], 16):
            tag, _value = struct.unpack_from("<qQ", data, off)
            if tag == DT_NULL:
                break
            count += tag == DT_NEEDED
    return count


def check(data, machine, min_align):
    problems = []
    e_type, e_machine, headers = program_headers(data)
    if e_machine != MACHINES[machine]:
        problems.append(f"e_machine is {e_machine}, want {MACHINES[machine]} ({machine})")
    if e_type not in (ET_EXEC, ET_DYN):
        problems.append(f"e_type is {e_type}, want an executable")
    if any(h["type"] == PT_INTERP for h in headers):
        problems.append("has PT_INTERP: it needs a dynamic loader")
    if n := needed(data, headers):
        problems.append(f"has {n} DT_NEEDED entries: it needs shared libraries")
    loads = [h for h in headers if h["type"] == PT_LOAD]
    if not loads:
        problems.append("no PT_LOAD segment")
    for h in loads:
        if h["align"] < min_align:
            problems.append(f"PT_LOAD at {h['vaddr']:#x} is aligned to {h['align']:#x}, want at least {min_align:#x}")
    return problems, loads


def main():
    path, machine, min_align = sys.argv[1], sys.argv[2], int(sys.argv[3], 0)
    if machine not in MACHINES:
        raise SystemExit(f"machine must be one of {', '.join(MACHINES)}, not {machine!r}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        problems, loads = check(data, machine, min_align)
    except (ValueError, struct.error) as e:
        raise SystemExit(f"{path}: {e}")
    if problems:
        raise SystemExit("\n".join(f"{path}: {p}" for p in problems))
    aligns = ", ".join(f"{h['align']:#x}" for h in loads)
    print(f"{path}: {machine}, static, no interpreter, {len(loads)} PT_LOAD aligned {aligns}")


if __name__ == "__main__":
    main()
