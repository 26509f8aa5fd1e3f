#!/usr/bin/env python3
"""Runs one command of the kernel library's ninja graph (csrc/build_graph.py) and reports on it.

    nvcc_wrap.py --name NAME --log LOG [--toolchain ID] [--depfile D --target OUT --keep-deps DIR]
                 -- COMMAND...

COMMAND's output goes to LOG, after a line with the command itself; for a kernel that output is
ptxas -v's register report. On success one line goes to stdout, `(TIME; sm_80: R regs, S B spill)`,
which build_graph.py prints after ninja's `[N/M] nvcc NAME`. On failure: NAME, LOG and LOG's last
lines, and COMMAND's exit status.

--depfile: nvcc's depfile D is rewritten to name OUT (ninja checks the name) and to list only the
files under DIR (csrc/). The CUTLASS headers of an isolated pip build lie in a new temporary
site-packages each time, freshly written: listed, they would recompile every object on every
`pip install`. A different nvcc or CUTLASS shows in --toolchain instead, which is only written to
the log: it is on the command line because ninja recompiles an object whose command changed.

Standard library only.
"""
import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TAIL_LINES = 60


def ptxas_summary(text: str) -> str:
    """'sm_80: 255 regs, 0 B spill' per SASS target, from ptxas -v output, and the count of each
    wgmma warning ('C7514 x4': ptxas's "Potential Performance Loss", wgmma serialized with a wait
    after each; one such kernel ran at 0.83x FlashAttention-3, docs/PERFLOG.md entry 102)."""
    regs, spill, arch = {}, {}, None
    warnings = {}
    for line in text.splitlines():
        m = re.search(r"\((C75\d\d)\) Potential Performance Loss", line)
        if m:
            warnings[m.group(1)] = warnings.get(m.group(1), 0) + 1
        m = re.search(r"for '(sm_\w+)'", line)
        if m:
            arch = m.group(1)
            continue
        if arch is None:
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            regs[arch] = max(regs.get(arch, 0), int(m.group(1)))
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill[arch] = spill.get(arch, 0) + int(m.group(1))
    return "; ".join([f"{a}: {regs[a]} regs, {spill.get(a, 0)} B spill" for a in sorted(regs)] +
                     [f"{w} x{n}" for w, n in sorted(warnings.items())])


def depfile_paths(text: str):
    """The prerequisites of a make-style depfile (one rule, as nvcc -MD writes it)."""
    parts = re.split(r":(?:\s|$)", text.replace("\\\n", " "), maxsplit=1)
    if len(parts) != 2:
        raise ValueError("no 'target: prerequisites' rule")
    return [t.replace("\\ ", " ") for t in re.findall(r"(?:\\ |\S)+", parts[1])]


def rewrite_depfile(depfile: Path, target: str, keep_under: str) -> None:
    keep_under = os.path.normpath(keep_under) + os.sep
    kept = []
    for p in depfile_paths(depfile.read_text()):
        p = os.path.normpath(os.path.join(os.getcwd(), p))
        if p.startswith(keep_under) and p not in kept:
            kept.append(p)
    lines = [f"{target}:"] + [" " + p.replace(" ", "\\ ") for p in kept]
    depfile.write_text(" \\\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the file, as progress lines name it")
    ap.add_argument("--log", required=True, type=Path)
    ap.add_argument("--toolchain", default="", help="nvcc and CUTLASS identity, for the log")
    ap.add_argument("--depfile", type=Path)
    ap.add_argument("--target", help="the output the depfile names")
    ap.add_argument("--keep-deps", help="the directory whose files the depfile keeps")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command after --")

    args.log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(args.log, "w") as f:
        if args.toolchain:
            f.write(f"# toolchain: {args.toolchain}\n")
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        except OSError as e:
            f.write(f"{e}\n")
            rc = 127
    dt = time.time() - t0
    text = args.log.read_text(errors="replace")

    if rc == 0 and args.depfile:
        try:
            rewrite_depfile(args.depfile, args.target, args.keep_deps)
        except (OSError, ValueError) as e:
            with open(args.log, "a") as f:
                f.write(f"cannot read the depfile {args.depfile}: {e}\n")
            text = args.log.read_text(errors="replace")
            rc = 1
    if rc == 0:
        summary = ptxas_summary(text)
        print(f"({dt:.1f}s{'; ' + summary if summary else ''})", flush=True)
        return 0

    lines = text.splitlines()
    errors = sum("error" in line.lower() for line in lines)
    print(f"cutlass_flash: {args.name} failed ({dt:.1f}s, exit status {rc}): {errors} error "
          f"line(s); last {min(TAIL_LINES, len(lines))} lines of {args.log}:", flush=True)
    print("\n".join(lines[-TAIL_LINES:]), flush=True)
    return rc if 0 < rc < 256 else 1


if __name__ == "__main__":
    sys.exit(main())
