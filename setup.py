"""Build of cutlass_flash: the CUDA kernel library and the pybind11 module.

    pip install .                      # or: pip install -e .   /   python setup.py build_ext --inplace

1. The kernel library, cutlass_flash/libcutlass_flash_kernels.so, is a ninja graph:
   csrc/build_graph.py writes build/kernels/build.ninja from csrc/generate.py's selection of
   instantiations (the knobs below) and runs ninja (the `ninja` package, a build requirement) on it.
   ninja recompiles only what changed, headers included (nvcc's depfiles); ptxas's register/spill
   report of each kernel is kept in build/ptxas_<name>.log. Inspect the graph with
   `ninja -C build/kernels -t targets` (or -t commands).
2. The host C++ compiler builds csrc/bindings.cpp into cutlass_flash/_C.<ext-suffix>, linked to the
   library with rpath $ORIGIN. Neither piece includes a torch or (for the library) Python header.

Build knobs (environment variables):
    CUTLASS_FLASH_ARCHS         kernel families (80: Ampere-style, 90: Hopper) default "80,90"
    CUTLASS_FLASH_HEAD_DIMS     head dims (64,96,128,192,256)                default all
    CUTLASS_FLASH_DTYPES        fp16,bf16                                    default both
    CUTLASS_FLASH_FWD_ONLY      1: no backward kernels                       default 0
    CUTLASS_FLASH_SM80_SASS     SASS targets of the sm80 family              default "80,90"
    CUTLASS_FLASH_SM90_SASS     SASS targets of the sm90 family              default "90a" (only)
    CUTLASS_FLASH_JOBS          parallel nvcc processes (ninja -j)           default all cores
    CUTLASS_FLASH_CUTLASS_DIR   a CUTLASS checkout whose include/ replaces the nvidia-cutlass wheel's
    CUTLASS_FLASH_NVCC_FLAGS    extra nvcc flags (before the include paths)   default none
    CUTLASS_FLASH_BINDING_ONLY  1: build only _C, against an existing
                                cutlass_flash/libcutlass_flash_kernels.so    default 0
    CUDA_HOME                   CUDA toolkit (else nvcc on PATH, else /usr/local/cuda)
"""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
PKG = ROOT / "cutlass_flash"


def load(name, path):
    """A csrc/ module by path (they are build scripts, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


graph = load("cutlass_flash_build_graph", CSRC / "build_graph.py")
BuildError, log, LIB_NAME, LIB_FILE = graph.BuildError, graph.log, graph.LIB_NAME, graph.LIB_FILE


def env_flag(name):
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise BuildError(f"{name}={os.environ[name]!r}: expected 1 or 0")


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
            lib = graph.build_library(load("cutlass_flash_generate", CSRC / "generate.py"))
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
