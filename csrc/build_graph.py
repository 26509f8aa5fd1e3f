"""The kernel library's build: a ninja graph written from csrc/generate.py's selection.

`build_library(gen)` (setup.py calls it; gen is csrc/generate.py loaded as a module):
1. reads the build knobs and selects the instantiations (`gen.select`), so the generator stays the
   only list of them; rewrites their translation units in csrc/generated/ if the generator
   changed, and writes the build's dispatch table into build/kernels/;
2. writes build/kernels/build.ninja (`write_graph`): one compile rule per kernel family and SASS
   target set (the family's -gencode flags), one for the host code (csrc/dispatch/api.cpp and the
   dispatch table), one link rule; one edge per object and one for the library;
3. runs ninja on it with CUTLASS_FLASH_JOBS jobs (`run_ninja`). ninja decides what is out of date:
   the objects whose command changed or whose inputs changed, including every csrc/ header that
   nvcc's depfile (deps = gcc) says the object includes.

Every command runs through csrc/nvcc_wrap.py, which keeps its output as a log
(build/ptxas_<name>.log for a kernel: ptxas -v's register report), prints the registers and
spills, and on failure the log's tail. The graph can be inspected and run by hand once written:
    ninja -C build/kernels -t targets      # or -t commands, -t deps; -n -d explain: what and why

Standard library only, like generate.py: setup.py runs this before any build dependency is
guaranteed (the `ninja` package is looked for when ninja is run).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

CSRC = Path(__file__).resolve().parent
ROOT = CSRC.parent
BUILD = ROOT / "build"              # ptxas logs: build/ptxas_<name>.log
KBUILD = BUILD / "kernels"          # build.ninja, objects, dispatch table, library
LIB_NAME = "cutlass_flash_kernels"
LIB_FILE = f"lib{LIB_NAME}.so"

NVCC_FLAGS = (
    "-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo",
    "-Xptxas=-v", "-Xfatbin=-compress-all", "-Xcompiler=-fPIC",
)
HOST_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC")
# Only the cutlass_flash namespace is exported; static cudart stays private (no clash with the
# libcudart torch loads), and it opens libcuda lazily, so import works with no GPU.
EXPORTS = '{\n  global:\n    extern "C++" { cutlass_flash::*; };\n  local: *;\n};\n'


class BuildError(SystemExit):
    def __init__(self, msg):
        super().__init__(f"cutlass_flash build error: {msg}")


def log(msg):
    print(msg, flush=True)


def num_jobs() -> int:
    v = os.environ.get("CUTLASS_FLASH_JOBS", "").strip()
    if v:
        if not v.isdigit() or int(v) < 1:
            raise BuildError(f"CUTLASS_FLASH_JOBS={v!r}: expected a positive integer")
        return int(v)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------
# Toolchain
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Toolchain:
    nvcc: str
    cutlass_include: str
    # nvcc's version and which CUTLASS: on every compile command (not the CUTLASS path, which
    # changes with each isolated pip build), so that changing either recompiles everything.
    identity: str


def find_nvcc() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda/bin/nvcc"
    raise BuildError("nvcc not found: set CUDA_HOME or put nvcc on PATH")


def cutlass_include() -> Tuple[str, str]:
    """(include dir, identity): CUTLASS_FLASH_CUTLASS_DIR's include/, or the nvidia-cutlass
    wheel's."""
    custom = os.environ.get("CUTLASS_FLASH_CUTLASS_DIR", "").strip()
    if custom:
        base = Path(custom).expanduser().resolve()
        for inc in (base / "include", base):
            if (inc / "cutlass" / "cutlass.h").exists() and (inc / "cute").is_dir():
                return str(inc), f"CUTLASS_FLASH_CUTLASS_DIR={inc}"
        raise BuildError(f"CUTLASS_FLASH_CUTLASS_DIR={custom!r}: no include/cutlass/cutlass.h "
                         f"and include/cute/ under it (point it at a CUTLASS checkout)")
    spec = importlib.util.find_spec("cutlass_library")   # locates it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("CUTLASS headers not found: install nvidia-cutlass==4.2.0.0 (a build "
                         "requirement; pip installs it in isolated builds) or set "
                         "CUTLASS_FLASH_CUTLASS_DIR to a CUTLASS checkout")
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    if not (inc / "cutlass" / "cutlass.h").exists():
        raise BuildError(f"{inc} holds no cutlass/cutlass.h: is nvidia-cutlass broken?")
    vh = (inc / "cutlass" / "version.h").read_text()
    m = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", vh) for k in ("MAJOR", "MINOR", "PATCH")]
    version = ".".join(x.group(1) for x in m) if all(m) else "?"
    return str(inc), f"nvidia-cutlass wheel, CUTLASS {version}"


def find_toolchain() -> Toolchain:
    nvcc = find_nvcc()
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from None
    inc, cutlass = cutlass_include()
    return Toolchain(nvcc, inc, f"nvcc {version}; {cutlass}")


def find_ninja() -> str:
    try:
        import ninja   # the build requirement (pyproject.toml), which ships the binary
        found = shutil.which("ninja", path=ninja.BIN_DIR)
        if found:
            return found
    except ImportError:
        pass
    found = shutil.which("ninja")
    if found:
        return found
    raise BuildError("ninja not found: `pip install ninja` (a build requirement, which pip "
                     "installs in isolated builds) or put ninja on PATH")


# ----------------------------------------------------------------------------------------------
# The graph
# ----------------------------------------------------------------------------------------------

def _path(p) -> str:
    """A path in a build line."""
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _shell(args) -> str:
    """Arguments as shell words, in a variable or command."""
    return " ".join(shlex.quote(str(a)) for a in args).replace("$", "$$")


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _point_link(link: Path, target: str) -> None:
    if not (link.is_symlink() and os.readlink(link) == target):
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        os.symlink(target, tmp)
        os.replace(tmp, link)


def sass_targets(gencode: Sequence[str]) -> List[str]:
    """['80', '90'] from ('-gencode', 'arch=compute_80,code=sm_80', ...)."""
    return [m for flag in gencode for m in re.findall(r"code=sm_(\w+)", flag)]


def write_graph(insts, table: Path, tc: Toolchain,
                extra_flags: Sequence[str] = ()) -> Dict[str, str]:
    """Writes KBUILD/build.ninja for `insts` (generate.select's list) and the dispatch table
    source `table`; returns each output's source file name, for error messages."""
    KBUILD.mkdir(parents=True, exist_ok=True)
    _write_if_changed(KBUILD / "exports.map", EXPORTS)
    # A fixed path to the CUTLASS headers, so that the commands stay the same across isolated pip
    # builds (a new temporary site-packages each time).
    cutlass = KBUILD / "cutlass-include"
    _point_link(cutlass, tc.cutlass_include)
    # The interpreter lives in this launcher, not in the commands: building with another Python
    # recompiles nothing.
    launcher = KBUILD / "nvcc_wrap"
    _write_if_changed(launcher, "#!/bin/sh\n# Written by csrc/build_graph.py.\nexec "
                      f"{_shell([sys.executable, CSRC / 'nvcc_wrap.py'])} \"$@\"\n")
    launcher.chmod(0o755)

    includes = ["-I" + str(CSRC), "-I" + str(CSRC / "include"), "-I" + str(cutlass)]
    out = [
        "# Written by csrc/build_graph.py from csrc/generate.py's selection; setup.py rewrites it",
        "# at each build. Inspect: ninja -C build/kernels -t targets | -t commands | -t deps.",
        "ninja_required_version = 1.10",
        f"wrap = {_shell([launcher])}",
        f"nvcc = {_shell([tc.nvcc])}",
        f"toolchain = {_shell([tc.identity])}",
        f"csrc = {_shell([CSRC])}",
        f"cuflags = {_shell(list(NVCC_FLAGS) + list(extra_flags) + includes)}",
        f"hostflags = {_shell(list(HOST_FLAGS) + list(extra_flags) + includes)}",
    ]

    def compile_rule(name: str, flags: str, comment: str):
        out.extend(["", f"# {comment}", f"rule {name}",
                    "  command = $wrap --name $name --log $log --toolchain $toolchain --depfile "
                    f"$out.d --target $out --keep-deps $csrc -- $nvcc {flags} -MD -MF $out.d "
                    "-c $in -o $out",
                    "  description = nvcc $name", "  depfile = $out.d", "  deps = gcc"])

    compile_rule("nvcc_host", "$hostflags", "Host code: csrc/dispatch/api.cpp, the dispatch table.")
    rules: Dict[Tuple[str, Tuple[str, ...]], str] = {}
    for inst in insts:
        key = (inst.family.namespace, tuple(inst.gencode))
        if key not in rules:
            targets = sass_targets(inst.gencode)
            rules[key] = f"nvcc_{key[0]}_sass_{'_'.join(targets)}"
            # One nvcc thread per SASS target: the sm80 backward's two ptxas runs (55-70 s each
            # on the 16-core machine) were the full build's longest jobs, and its tail.
            threads = ("--threads", str(len(targets))) if len(targets) > 1 else ()
            compile_rule(rules[key], "$cuflags " + _shell(tuple(inst.gencode) + threads),
                         f"The {key[0]} family's kernels, SASS for {', '.join(targets)}.")

    out.append("")
    names: Dict[str, str] = {}

    def edge(rule: str, obj: str, src: Path, log_path: Path):
        names[obj] = src.name
        out.extend([f"build {_path(obj)}: {rule} {_path(src)}",
                    f"  name = {_shell([src.name])}",
                    f"  log = {_shell([log_path])}"])

    # ninja starts ready edges in the order they are written: the costliest first (more SASS
    # targets, then the backward, whose kernels take ptxas longer), so that no long job starts
    # last and runs alone (LPT order; 289 -> 276 s simulated on the 16-core machine's job times).
    # Measured on the 16-core GPU machine (PERFLOG 72): sm80 backward 103-122 s, sm80 forward
    # 62-92 s, the two sm90 instantiations with CuTe's extended wgmma shapes 75-94 s, the other
    # sm90 ones 39-57 s; those two last in the queue made the tail (a simulation of the measured
    # times: 230 s against 214 s with them first among the sm90 files).
    def cost(inst) -> Tuple[int, int, int]:
        return (-len(sass_targets(inst.gencode)), 0 if inst.extended_gmma else 1, 0 if inst.direction == "bwd" else 1)

    for inst in sorted(insts, key=cost):
        edge(rules[(inst.family.namespace, tuple(inst.gencode))], inst.stem + ".o", inst.source,
             BUILD / f"ptxas_{inst.stem}.log")
    for src in (CSRC / "dispatch" / "api.cpp", table):
        edge("nvcc_host", src.stem + ".o", src, KBUILD / f"{src.stem}.log")

    link = ["-shared", "-cudart", "static", "-Xfatbin=-compress-all",
            "-Xlinker", "--exclude-libs,ALL", "-Xlinker", "--version-script=exports.map",
            "-Xlinker", f"-soname,{LIB_FILE}", "-Xlinker", "--no-undefined"]
    objs = list(names)
    names[LIB_FILE] = LIB_FILE
    out += ["",
            "rule link",
            f"  command = $wrap --name $out --log link.log -- $nvcc {_shell(link)} -o $out $in",
            "  description = link $out",
            "",
            f"build {LIB_FILE}: link {' '.join(_path(o) for o in objs)} | exports.map",
            f"default {LIB_FILE}",
            ""]
    _write_if_changed(KBUILD / "build.ninja", "\n".join(out))
    return names


# ----------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------

STATUS = re.compile(r"\[\d+/\d+\] ")
SUMMARY = re.compile(r"\(\d+\.\d+s[;)]")        # nvcc_wrap.py's line on success
FAILED = re.compile(r"FAILED: (?:\[code=\d+\] )?(.*)")


def run_ninja(jobs: int, names: Dict[str, str]) -> None:
    """Runs ninja in KBUILD; its status line and the wrapper's summary of the same edge become one
    progress line: `[N/M] nvcc <file> (time; registers, spills)`."""
    cmd = [find_ninja(), "-C", str(KBUILD), "-j", str(jobs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=dict(os.environ, NINJA_STATUS="[%f/%t] "))
    failed, held = [], None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if held is not None and SUMMARY.match(line):
            log(f"{held} {line}")
            held = None
            continue
        if held is not None:
            log(held)
            held = None
        if STATUS.match(line):
            held = line
            continue
        m = FAILED.match(line)
        if m:
            failed += [names.get(o, o) for o in m.group(1).split()]
        log(line)
    if held is not None:
        log(held)
    if proc.wait() != 0:
        what = f"{', '.join(failed)} failed to build (the log's tail is above)" if failed \
            else "ninja failed (see above)"
        raise BuildError(f"{what}; rerun: {shlex.join(cmd)}")


def build_library(gen) -> Path:
    """Builds KBUILD/libcutlass_flash_kernels.so for the knobs in the environment; gen is
    csrc/generate.py loaded as a module."""
    try:
        knobs = gen.Knobs.from_env()
    except gen.KnobError as e:
        raise BuildError(str(e)) from None
    insts = gen.select(knobs)
    tc = find_toolchain()
    jobs = num_jobs()
    log(f"cutlass_flash: {len(insts)} kernel instantiations ({knobs.describe()}); "
        f"{tc.identity}; nvcc: {tc.nvcc}; CUTLASS: {tc.cutlass_include}")

    gen.write_generated(gen.GENERATED_DIR, insts, prune=False)
    table = KBUILD / "dispatch_table.cpp"
    gen.write_dispatch_table(table, insts, knobs)
    names = write_graph(insts, table, tc,
                        shlex.split(os.environ.get("CUTLASS_FLASH_NVCC_FLAGS", "")))
    log(f"cutlass_flash: ninja -C {KBUILD} -j {jobs} (CUTLASS_FLASH_JOBS)")
    t0 = time.time()
    run_ninja(jobs, names)
    lib = KBUILD / LIB_FILE
    log(f"cutlass_flash: {lib} ({lib.stat().st_size / 2**20:.1f} MiB; {time.time() - t0:.1f}s)")
    return lib
