#!/usr/bin/env python3
"""Registers, stack frame and local-memory traffic of each compiled kernel instantiation, one line
each, read off a build's objects with cuobjdump (no GPU needed), so that a change that adds
spills shows before any GPU run.

    scripts/kernel_resources.py BUILD_DIR [--filter fwd_] [--check RECORD] [--write RECORD]

Per kernel instantiation (src/hopper/instantiations/*.cu hold several: each row is named by its
variant, e.g. fwd_bf16_hdim128_causal_softcap): REG and STACK (bytes of stack
frame, where spills go) from --dump-resource-usage; from the disassembly, the local loads and
stores (LDL, STL) in all and in the key-block loop (from the first to the last warpgroup MMA,
where a spill costs every block), and the loop's R2UR moves (values copied into uniform
registers, such as WGMMA descriptors computed from a tile index the compiler cannot prove
uniform). --check compares with a record (lines: instantiation stack loop_local), and fails when a
kernel's stack or its loop's local traffic grew. cuobjdump: $CUOBJDUMP, else on PATH, else next to
nvcc.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

OBJECTS = os.path.join("CMakeFiles", "flashhopper_kernels.dir", "src", "hopper", "instantiations")
MASK_KINDS = ("kNone", "kCausal", "kLocal")  # hopper::MaskKind's enumerators by value

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_manifest as manifest  # noqa: E402


def variant_names() -> dict:
    """{instantiation file stem: {(MaskKind enumerator, softcap): the variant's name}}."""
    names = {}
    for family in manifest.families():
        for suffix, members in family.units().items():
            names[family.stem + suffix] = {(kind, softcap == "true"): f"{family.stem}_{name}"
                                           for name, kind, softcap, _ in members}
    return names


def kernel_name(file_stem: str, kernel: str, names: dict) -> str:
    """A kernel's variant name (fwd_bf16_hdim128_causal_softcap), from its file and the mask kind and
    softcap in its mangled name; a dQ kernel's ends in _dq. The file's stem where it is not in the
    manifest (an older build)."""
    m = re.search(r"MaskKindE(\d)ELb([01])", kernel)
    variants = names.get(file_stem)
    if not m or variants is None:
        return file_stem
    name = variants.get((MASK_KINDS[int(m.group(1))], m.group(2) == "1"), file_stem)
    return name + ("_dq" if "dq_kernel_entry" in kernel else "")


def cuobjdump() -> str:
    for candidate in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                      os.path.join(os.path.dirname(shutil.which("nvcc") or ""), "cuobjdump")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("kernel_resources: no cuobjdump (set CUOBJDUMP, or put the CUDA toolkit's bin on PATH)")


def resource_usage(text: str) -> dict:
    """{kernel: (REG, STACK)} from cuobjdump --dump-resource-usage."""
    out, function = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            function = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and function:
            out[function] = (int(m.group(1)), int(m.group(2)))
            function = None
    return out


def local_traffic(sass: str) -> dict:
    """{kernel: (local loads+stores in all, those in the span from the first to the last MMA, the
    span's R2UR moves)}."""
    out, function, body = {}, None, []

    def close():
        if function is not None:
            local = [i for i, ins in enumerate(body) if re.search(r"\b(LDL|STL)\b", ins)]
            mma = [i for i, ins in enumerate(body) if re.search(r"\b[HQ]GMMA\b", ins)]
            span = body[mma[0]:mma[-1] + 1] if mma else []
            in_loop = sum(1 for i in local if mma and mma[0] <= i <= mma[-1])
            out[function] = (len(local), in_loop, sum(1 for ins in span if re.search(r"\bR2UR\b", ins)))

    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            close()
            function, body = m.group(1), []
        elif function is not None and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            body.append(line.split(";")[0])
    close()
    return out


def measure(build: str, name_filter: str) -> list:
    tool = cuobjdump()
    folder = os.path.join(build, OBJECTS)
    if not os.path.isdir(folder):
        sys.exit(f"kernel_resources: no instantiation objects in {folder}")
    rows, names = [], variant_names()
    for entry in sorted(os.listdir(folder)):
        if not entry.endswith(".cu.o"):
            continue
        path = os.path.join(folder, entry)
        usage = resource_usage(subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                                              text=True).stdout)
        traffic = local_traffic(subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout)
        for kernel, (reg, stack) in usage.items():
            if "kernel_entry" not in kernel:
                continue
            name = kernel_name(entry[:-len(".cu.o")], kernel, names)
            if name_filter not in name:
                continue
            total, loop, r2ur = traffic.get(kernel, (-1, -1, -1))
            rows.append((name, kernel, reg, stack, total, loop, r2ur))
    return sorted(rows)


def read_record(path: str) -> dict:
    if not os.path.isfile(path):
        sys.exit(f"kernel_resources: no record {path} (make one with --write)")
    record = {}
    with open(path) as f:
        for line in f:
            fields = line.split("#")[0].split()
            if len(fields) == 3:
                record[fields[0]] = (int(fields[1]), int(fields[2]))
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a build folder (cmake -B)")
    parser.add_argument("--filter", default="", help="only instantiations whose name holds this")
    parser.add_argument("--check", metavar="RECORD", help="fail where stack or loop local traffic grew")
    parser.add_argument("--write", metavar="RECORD", help="write this build's figures as the record")
    args = parser.parse_args()
    rows = measure(args.build, args.filter)
    record = read_record(args.check) if args.check else {}
    grew = 0
    print(f"{'instantiation':42s} {'REG':>4s} {'STACK':>6s} {'local':>6s} {'in loop':>8s} {'R2UR':>5s}  record")
    for name, _, reg, stack, total, loop, r2ur in rows:
        note = ""
        if name in record:
            old_stack, old_loop = record[name]
            worse = stack > old_stack or loop > old_loop
            grew += worse
            note = f"{old_stack} / {old_loop}" + ("  GREW" if worse else "")
        print(f"{name:42s} {reg:4d} {stack:6d} {total:6d} {loop:8d} {r2ur:5d}  {note}")
    if args.write:
        with open(args.write, "w") as f:
            f.write("# instantiation, stack frame bytes, local loads/stores in the key-block loop "
                    "(scripts/kernel_resources.py --write)\n")
            for name, _, _, stack, _, loop, _ in rows:
                f.write(f"{name} {stack} {loop}\n")
    if not rows:
        print("kernel_resources: no kernels found")
        return 1
    checked = sum(1 for r in rows if r[0] in record)
    print(f"kernel resources: {len(rows)} kernels, {checked} against the record, {grew} grew")
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
