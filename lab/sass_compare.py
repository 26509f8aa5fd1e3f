"""Whether two builds of the kernel library have the same machine code, kernel by kernel:

    python lab/sass_compare.py BASE.so NEW.so [--show N]

Each function's SASS (cuobjdump -sass) with its name and the symbols it calls replaced, so that
renamed types (mangled names) do not count as changes; the bodies are compared as multisets per
SASS target. Prints the counts and, for bodies found in one build only, their names and
instruction counts (the first N)."""

import argparse
import collections
import hashlib
import re
import subprocess
import sys

_SYM = re.compile(r"_Z\w+")


def functions(path):
    """{(target, body hash): [names]} and {name: instruction count} of a library's SASS."""
    text = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True, text=True).stdout
    bodies = collections.defaultdict(list)
    counts = {}
    target, name, lines = None, None, []

    def flush():
        if name is not None:
            digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()
            bodies[(target, digest)].append(name)
            counts[name] = len(lines)

    for line in text.splitlines():
        m = re.match(r"\s*code for (sm_\w+)", line)
        if m:
            flush()
            target, name, lines = m.group(1), None, []
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            flush()
            name, lines = m.group(1), []
            continue
        if name is not None and "/*" in line and ";" in line:
            lines.append(_SYM.sub("SYM", line.strip()))
    flush()
    return bodies, counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--show", type=int, default=20)
    a = p.parse_args(argv)
    base, base_counts = functions(a.base)
    new, new_counts = functions(a.new)
    nb = sum(len(v) for v in base.values())
    nn = sum(len(v) for v in new.values())
    only_base = [(k, v) for k, v in base.items() if k not in new]
    only_new = [(k, v) for k, v in new.items() if k not in base]
    print(f"functions: base {nb}, new {nn}; distinct bodies: base {len(base)}, new {len(new)}; "
          f"only in base {len(only_base)}, only in new {len(only_new)}")
    for label, items, counts in (("base", only_base, base_counts), ("new", only_new, new_counts)):
        for (target, _), names in items[:a.show]:
            print(f"  only in {label} [{target}] {counts[names[0]]} instructions: {names[0][:160]}")
    return 0 if not only_base and not only_new and nb == nn else 1


if __name__ == "__main__":
    sys.exit(main())
