"""Build of cutlass_flash: the CUDA kernel library and the pybind11 module.

    pip install .                      # or: pip install -e .   /   python setup.py build_ext --inplace

1. csrc/generate.py selects the instantiations from the build knobs (below) and writes the build's
   dispatch table into build/kernels/.
2. nvcc compiles each selected csrc/generated/*.cu (in parallel, incrementally) and the host glue
   (csrc/dispatch/api.cpp + the table) and links them into cutlass_flash/libcutlass_flash_kernels.so
   (static cudart, compressed fatbins). ptxas's register/spill report of each object is kept in
   build/ptxas_<name>.log.
3. The host C++ compiler builds csrc/bindings.cpp into cutlass_flash/_C.<ext-suffix>, linked to the
   library with rpath $ORIGIN. Neither piece includes a torch or (for the library) Python header.

Build knobs (environment variables):
    CUTLASS_FLASH_ARCHS         kernel families (80: Ampere-style, 90: Hopper) default "80,90"
    CUTLASS_FLASH_HEAD_DIMS     head dims (64,96,128,192,256)                default all
    CUTLASS_FLASH_DTYPES        fp16,bf16                                    default both
    CUTLASS_FLASH_FWD_ONLY      1: no backward kernels                       default 0
    CUTLASS_FLASH_SM80_SASS     SASS targets of the sm80 family              default "80,90"
    CUTLASS_FLASH_SM90_SASS     SASS targets of the sm90 family              default "90a" (only)
    CUTLASS_FLASH_JOBS          parallel nvcc processes                      default all cores
    CUTLASS_FLASH_CUTLASS_DIR   a CUTLASS checkout whose include/ replaces the nvidia-cutlass wheel's
    CUTLASS_FLASH_NVCC_FLAGS    extra nvcc flags (before the include paths)   default none
    CUTLASS_FLASH_BINDING_ONLY  1: build only _C, against an existing
                                cutlass_flash/libcutlass_flash_kernels.so    default 0
    CUDA_HOME                   CUDA toolkit (else nvcc on PATH, else /usr/local/cuda)
"""
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
PKG = ROOT / "cutlass_flash"
BUILD = ROOT / "build"              # ptxas logs: build/ptxas_<name>.log
KBUILD = BUILD / "kernels"          # objects, dispatch table, library
LIB_NAME = "cutlass_flash_kernels"
LIB_FILE = f"lib{LIB_NAME}.so"
HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")

NVCC_FLAGS = [
    "-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-DNDEBUG", "-lineinfo",
    "-Xptxas=-v", "-Xfatbin=-compress-all", "-Xcompiler=-fPIC",
]
HOST_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC"]


class BuildError(SystemExit):
    def __init__(self, msg):
        super().__init__(f"cutlass_flash build error: {msg}")


def log(msg):
    print(msg, flush=True)


def load_generator():
    spec = importlib.util.spec_from_file_location("cutlass_flash_generate", CSRC / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def env_flag(name):
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise BuildError(f"{name}={os.environ[name]!r}: expected 1 or 0")


def num_jobs():
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
# Toolchain discovery
# ----------------------------------------------------------------------------------------------

def find_nvcc():
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


def find_cuda_include():
    """Directory of cuda_runtime_api.h, for the host compile of bindings.cpp."""
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(Path(os.path.realpath(nvcc)).parent.parent / "include")
    cands += [Path("/usr/local/cuda/include"), Path("/usr/include")]
    # pip-installed CUDA runtime headers (nvidia-cuda-runtime*), e.g. next to a CUDA torch
    for sp in sys.path:
        cands += sorted(Path(sp).glob("nvidia/*/include")) if sp and Path(sp).is_dir() else []
    for c in cands:
        if (c / "cuda_runtime_api.h").exists():
            return str(c)
    raise BuildError("cuda_runtime_api.h not found: set CUDA_HOME to a CUDA toolkit")


def cutlass_include():
    """(include dir, signature): CUTLASS_FLASH_CUTLASS_DIR's include/ or the nvidia-cutlass wheel's.

    The signature goes into each object's recorded command instead of the path, so an isolated pip
    build (a new temporary site-packages each time) does not recompile up-to-date objects."""
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
    version = "?"
    vh = (inc / "cutlass" / "version.h").read_text()
    m = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", vh) for k in ("MAJOR", "MINOR", "PATCH")]
    if all(m):
        version = ".".join(x.group(1) for x in m)
    return str(inc), f"nvidia-cutlass wheel, CUTLASS {version}"


# ----------------------------------------------------------------------------------------------
# Incremental compilation
# ----------------------------------------------------------------------------------------------

def csrc_headers():
    return [p for p in CSRC.rglob("*") if p.suffix in HEADER_SUFFIXES and p.is_file()]


def depfile_headers(dep: Path):
    """Headers under csrc/ an object depends on, from nvcc's -MD file; None if unreadable."""
    try:
        text = dep.read_text()
    except OSError:
        return None
    body = text.replace("\\\n", " ").split(":", 1)
    if len(body) != 2:
        return None
    out = []
    csrc = str(CSRC)
    for tok in body[1].split():
        p = os.path.realpath(os.path.join(ROOT, tok.replace("\\ ", " ")))
        if p.startswith(csrc + os.sep) and p.endswith(HEADER_SUFFIXES):
            out.append(Path(p))
    return out


class Job:
    def __init__(self, src: Path, obj: Path, cmd, signature: str, log_path: Path, display: str,
                 depfile: Path):
        self.src, self.obj, self.cmd, self.signature = src, obj, cmd, signature
        self.log_path, self.display, self.depfile = log_path, display, depfile

    @property
    def sigfile(self):
        return self.obj.with_name(self.obj.name + ".cmd")

    def up_to_date(self, all_headers):
        if not self.obj.exists() or not self.sigfile.exists():
            return False
        if self.sigfile.read_text() != self.signature:
            return False
        t = self.obj.stat().st_mtime
        deps = depfile_headers(self.depfile)
        if deps is None:
            deps = all_headers   # no dependency list: every header under csrc/ counts
        for p in [self.src] + list(deps):
            try:
                if p.stat().st_mtime > t:
                    return False
            except FileNotFoundError:
                return False    # a header it used is gone
        return True

    def run(self):
        self.obj.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.obj.with_name(self.obj.name + ".tmp")
        cmd = self.cmd + ["-MD", "-MF", str(self.depfile), "-c", str(self.src), "-o", str(tmp)]
        t0 = time.time()
        with open(self.log_path, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
        dt = time.time() - t0
        if rc == 0:
            os.replace(tmp, self.obj)
            self.sigfile.write_text(self.signature)
        else:
            for p in (tmp, self.sigfile):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
        return rc, dt


def ptxas_summary(log_path: Path) -> str:
    """'sm_80: 255 regs, 0 B spill' per SASS target, from a ptxas -v log."""
    regs, spill, arch = {}, {}, None
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
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
    parts = [f"{a}: {regs[a]} regs, {spill.get(a, 0)} B spill" for a in sorted(regs)]
    return "; ".join(parts)


def compile_all(jobs, n_parallel):
    """Compiles the out-of-date jobs, n_parallel at a time, printing one line as each ends."""
    all_headers = csrc_headers()
    todo = [j for j in jobs if not j.up_to_date(all_headers)]
    skipped = len(jobs) - len(todo)
    if skipped:
        log(f"cutlass_flash: {skipped} of {len(jobs)} objects up to date")
    if not todo:
        return 0
    log(f"cutlass_flash: compiling {len(todo)} files with {min(n_parallel, len(todo))} parallel "
        f"nvcc job(s) (CUTLASS_FLASH_JOBS)")
    failures, cancelled = [], []
    done = 0
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=n_parallel) as pool:
        futs = {pool.submit(j.run): j for j in todo}
        for fut in as_completed(futs):
            j = futs[fut]
            if fut.cancelled():
                cancelled.append(j)
                continue
            try:
                rc, dt = fut.result()
            except Exception as e:  # noqa: BLE001 - reported below
                rc, dt = -1, 0.0
                with open(j.log_path, "a") as f:
                    f.write(f"\n{e!r}\n")
            with lock:
                done += 1
                if rc == 0:
                    summary = ptxas_summary(j.log_path)
                    extra = f"; {summary}" if summary else ""
                    log(f"[{done}/{len(todo)}] compiled {j.display} ({dt:.1f}s{extra})")
                else:
                    log(f"[{done}/{len(todo)}] FAILED {j.display} ({dt:.1f}s), log: {j.log_path}")
                    if not failures:
                        for f in futs:   # start nothing new; let running compiles finish
                            f.cancel()
                    failures.append(j)
    if failures:
        for j in failures:
            text = j.log_path.read_text(errors="replace").splitlines()
            errs = [l for l in text if "error" in l.lower()]
            log(f"---- {j.display}: {len(errs)} error line(s); last lines of {j.log_path}:")
            log("\n".join(text[-60:]))
        if cancelled:
            log(f"not compiled after the first failure: {', '.join(j.display for j in cancelled)}")
        raise BuildError(f"{len(failures)} file(s) failed to compile: "
                         f"{', '.join(j.display for j in failures)}")
    return len(todo)


# ----------------------------------------------------------------------------------------------
# The kernel library
# ----------------------------------------------------------------------------------------------

def build_kernel_library() -> Path:
    gen = load_generator()
    try:
        knobs = gen.Knobs.from_env()
    except gen.KnobError as e:
        raise BuildError(str(e)) from None
    insts = gen.select(knobs)
    nvcc = find_nvcc()
    inc, cutlass_sig = cutlass_include()
    extra = shlex.split(os.environ.get("CUTLASS_FLASH_NVCC_FLAGS", ""))
    includes = ["-I" + str(CSRC), "-I" + str(CSRC / "include"), "-I" + inc]
    try:
        nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from None
    log(f"cutlass_flash: {len(insts)} kernel instantiations ({knobs.describe()}); "
        f"nvcc: {nvcc} ({nvcc_version}); CUTLASS: {inc}")

    # The committed translation units (rewritten only if the generator changed) + the table.
    gen.write_generated(gen.GENERATED_DIR, insts, prune=False)
    KBUILD.mkdir(parents=True, exist_ok=True)
    table = KBUILD / "dispatch_table.cpp"
    gen.write_dispatch_table(table, insts, knobs)

    def sig(cmd):
        s = [cutlass_sig if c == "-I" + inc else c for c in cmd]
        return nvcc_version + "\n" + shlex.join(s) + "\n"

    jobs = []
    for i in insts:
        cmd = [nvcc] + NVCC_FLAGS + extra + includes + list(i.gencode)
        jobs.append(Job(i.source, KBUILD / (i.stem + ".o"), cmd, sig(cmd),
                        BUILD / f"ptxas_{i.stem}.log", i.filename, KBUILD / (i.stem + ".d")))
    for src, stem in ((CSRC / "dispatch" / "api.cpp", "api"), (table, "dispatch_table")):
        cmd = [nvcc] + HOST_FLAGS + extra + includes
        jobs.append(Job(src, KBUILD / (stem + ".o"), cmd, sig(cmd), KBUILD / f"{stem}.log",
                        src.name, KBUILD / (stem + ".d")))

    t0 = time.time()
    compile_all(jobs, num_jobs())

    # Link. Only the cutlass_flash namespace is exported; static cudart stays private (no clash
    # with the libcudart torch loads), and it opens libcuda lazily, so import works with no GPU.
    lib = KBUILD / LIB_FILE
    exports = KBUILD / "exports.map"
    from_gen = 'extern "C++" { cutlass_flash::*; };'
    exports_text = "{\n  global:\n    " + from_gen + "\n  local: *;\n};\n"
    if not exports.exists() or exports.read_text() != exports_text:
        exports.write_text(exports_text)
    objs = [str(j.obj) for j in jobs]
    link = [nvcc, "-shared", "-cudart", "static", "-Xfatbin=-compress-all",
            "-Xlinker", "--exclude-libs,ALL", "-Xlinker", f"--version-script={exports}",
            "-Xlinker", f"-soname,{LIB_FILE}", "-Xlinker", "--no-undefined",
            "-o", str(lib)] + objs
    link_sig = KBUILD / (LIB_FILE + ".cmd")
    link_text = nvcc_version + "\n" + shlex.join(link) + "\n"
    stale = (not lib.exists() or not link_sig.exists() or link_sig.read_text() != link_text
             or any(Path(o).stat().st_mtime > lib.stat().st_mtime for o in objs))
    if stale:
        res = subprocess.run(link, capture_output=True, text=True, cwd=str(ROOT))
        if res.returncode != 0:
            log(res.stdout + res.stderr)
            raise BuildError(f"linking {LIB_FILE} failed")
        link_sig.write_text(link_text)
        log(f"cutlass_flash: linked {lib} ({lib.stat().st_size / 2**20:.1f} MiB, "
            f"{time.time() - t0:.1f}s in all)")
    else:
        log(f"cutlass_flash: {lib} up to date")
    return lib


# ----------------------------------------------------------------------------------------------
# setuptools glue
# ----------------------------------------------------------------------------------------------

class BuildExt(build_ext):
    """Builds the kernel library, then _C against it; ships the library next to _C."""

    def run(self):
        if env_flag("CUTLASS_FLASH_BINDING_ONLY"):
            lib = PKG / LIB_FILE
            if not lib.exists():
                raise BuildError(
                    f"CUTLASS_FLASH_BINDING_ONLY=1 needs {lib}, built elsewhere by "
                    f"`python setup.py build_ext --inplace` (or pip install -e .) and copied here")
            log(f"cutlass_flash: CUTLASS_FLASH_BINDING_ONLY=1, using {lib}")
        else:
            lib = build_kernel_library()
        self._kernel_lib = lib
        super().run()

    def _lib_dest(self):
        # Next to the regular (non-inplace) _C output, in build_lib.
        return Path(self.build_lib) / "cutlass_flash" / LIB_FILE

    def build_extension(self, ext):
        import pybind11

        lib = self._kernel_lib
        dest = self._lib_dest()
        dest.parent.mkdir(parents=True, exist_ok=True)
        if lib.resolve() != dest.resolve():
            shutil.copy2(lib, dest)
        ext.include_dirs = [str(CSRC / "include"), str(CSRC), pybind11.get_include(),
                            find_cuda_include()]
        ext.library_dirs = [str(dest.parent)]
        ext.libraries = [LIB_NAME]
        ext.extra_link_args = ["-Wl,-rpath,$ORIGIN"]
        # Rebuild _C when the library or a header bindings.cpp includes changes.
        ext.depends = [str(lib)] + [str(p) for p in sorted((CSRC / "include").rglob("*.h"))] + \
            [str(p) for p in sorted((CSRC / "dispatch").glob("*.h"))]
        super().build_extension(ext)

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        inplace = PKG / LIB_FILE
        src = self._lib_dest()
        if src.exists() and src.resolve() != inplace.resolve():
            shutil.copy2(src, inplace)

    def _get_output_mapping(self):
        yield from super()._get_output_mapping()
        if self.inplace:
            yield (str(self._lib_dest()), str(PKG / LIB_FILE))

    def get_outputs(self):
        outs = super().get_outputs()
        if not self.inplace:
            outs = sorted(outs + [str(self._lib_dest())])
        return outs


setup(
    ext_modules=[Extension("cutlass_flash._C", sources=["csrc/bindings.cpp"], language="c++",
                           extra_compile_args=["-std=c++17", "-O2", "-g0", "-fvisibility=hidden"])],
    cmdclass={"build_ext": BuildExt},
)
