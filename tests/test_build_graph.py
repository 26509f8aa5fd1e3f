"""The kernel library's ninja build (csrc/build_graph.py), on CPU, in a copy of csrc/.

The graph test writes the graph of the CI knobs and queries it with `ninja -t` (no compile). The
incremental test builds one instantiation for real (about 25 s of nvcc), then checks that an
unchanged tree, or new CUTLASS headers at another path (each isolated pip build has its own),
rebuild nothing, and that touching a header recompiles exactly the objects that include it. Both work on a
copy of csrc/, so the checkout's build/ and headers are left alone. Without nvcc, ninja or the
CUTLASS headers they skip, except under CI (CI=true), where they fail.
"""
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ONE_INSTANTIATION = {
    "CUTLASS_FLASH_ARCHS": "80", "CUTLASS_FLASH_HEAD_DIMS": "64", "CUTLASS_FLASH_DTYPES": "bf16",
    "CUTLASS_FLASH_FWD_ONLY": "1", "CUTLASS_FLASH_SM80_SASS": "80",
}
CI_KNOBS = {
    "CUTLASS_FLASH_ARCHS": "80,90", "CUTLASS_FLASH_HEAD_DIMS": "64", "CUTLASS_FLASH_DTYPES": "bf16",
    "CUTLASS_FLASH_SM80_SASS": "80",
}
PROGRESS = re.compile(r"\[\d+/\d+\] nvcc (\S+) \(")
_copies = itertools.count()


def _unavailable(reason):
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        pytest.fail(f"{reason} (CI must run this test)")
    pytest.skip(reason)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """(generate, build_graph) loaded from a copy of csrc/ in tmp_path: the build goes to
    tmp_path/build. Knob variables of the caller's environment are cleared."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc", ignore=shutil.ignore_patterns("__pycache__"))
    for var in list(os.environ):
        if var.startswith("CUTLASS_FLASH_") and var not in ("CUTLASS_FLASH_JOBS",
                                                             "CUTLASS_FLASH_CUTLASS_DIR"):
            monkeypatch.delenv(var)
    n = next(_copies)
    gen = _load(f"cutlass_flash_generate_copy{n}", tmp_path / "csrc" / "generate.py")
    graph = _load(f"cutlass_flash_build_graph_copy{n}", tmp_path / "csrc" / "build_graph.py")
    assert graph.KBUILD == tmp_path / "build" / "kernels"
    return gen, graph


def _ninja(graph, *args):
    return subprocess.run([graph.find_ninja(), "-C", str(graph.KBUILD), *args], check=True,
                          capture_output=True, text=True).stdout


def _find_ninja(graph):
    try:
        return graph.find_ninja()
    except SystemExit as e:
        _unavailable(str(e))


def test_graph_of_ci_knobs(tree, monkeypatch):
    gen, graph = tree
    _find_ninja(graph)
    for k, v in CI_KNOBS.items():
        monkeypatch.setenv(k, v)
    knobs = gen.Knobs.from_env()
    insts = gen.select(knobs)
    table = graph.KBUILD / "dispatch_table.cpp"
    tc = graph.Toolchain("/cuda/bin/nvcc", "/cutlass/include", "nvcc 13.0; CUTLASS 4.2.0")
    names = graph.write_graph(insts, table, tc)
    text = (graph.KBUILD / "build.ninja").read_text()

    # one rule per kernel family and SASS target set, each with nvcc's depfile
    rules = re.findall(r"^rule (\S+)", text, re.M)
    assert sorted(rules) == ["link", "nvcc_host", "nvcc_sm80_sass_80", "nvcc_sm90_sass_90a"]
    assert text.count("  deps = gcc\n") == text.count("  depfile = $out.d\n") == 3
    for rule, arch in (("nvcc_sm80_sass_80", 80), ("nvcc_sm90_sass_90a", 90)):
        objs = _ninja(graph, "-t", "targets", "rule", rule).split()
        assert sorted(objs) == sorted(i.stem + ".o" for i in insts if i.arch == arch)

    # every selected instantiation: its committed source, its flags, its log, nothing else
    objs = {i.stem + ".o": i for i in insts}
    assert set(names) == set(objs) | {"api.o", "dispatch_table.o", graph.LIB_FILE}
    commands = _ninja(graph, "-t", "commands", graph.LIB_FILE).splitlines()
    assert len(commands) == len(names)
    for obj, inst in objs.items():
        (cmd,) = [c for c in commands if c.endswith(f" -o {obj}")]
        assert f" {' '.join(inst.gencode)} " in cmd and f" -c {inst.source} " in cmd
        assert f"--log {graph.BUILD / ('ptxas_' + inst.stem + '.log')} " in cmd
        assert "-I" + str(graph.KBUILD / "cutlass-include") in cmd and "/cutlass/include" not in cmd
        assert "--toolchain 'nvcc 13.0; CUTLASS 4.2.0'" in cmd
    assert _ninja(graph, "-t", "query", graph.LIB_FILE).count(".o") == len(names) - 1


def _build(graph, gen, capsys):
    """Runs the build as setup.py does; returns the files it compiled and its output."""
    graph.build_library(gen)
    out = capsys.readouterr().out
    return sorted(PROGRESS.findall(out)), out


def _touch(path, graph):
    """Makes `path` newer than everything built so far, but not newer than now: a header dated in
    the future would stay newer than the objects rebuilt from it."""
    newest = max(p.stat().st_mtime for p in graph.KBUILD.iterdir())
    while time.time() <= newest + 0.01:
        time.sleep(0.02)
    os.utime(path)


def test_incremental_build_of_one_instantiation(tree, monkeypatch, capsys, tmp_path):
    gen, graph = tree
    _find_ninja(graph)
    try:
        graph.find_toolchain()
    except SystemExit as e:
        _unavailable(str(e))
    for k, v in ONE_INSTANTIATION.items():
        monkeypatch.setenv(k, v)
    (inst,) = gen.select()
    csrc = tmp_path / "csrc"

    compiled, out = _build(graph, gen, capsys)
    assert compiled == sorted([inst.filename, "api.cpp", "dispatch_table.cpp"]), out
    assert re.search(rf"\] nvcc {inst.filename} \(\d+\.\ds; sm_80: \d+ regs, \d+ B spill\)", out)
    assert "Used" in (graph.BUILD / f"ptxas_{inst.stem}.log").read_text()
    lib = graph.KBUILD / graph.LIB_FILE
    assert lib.exists()

    # nvcc's depfile, as ninja recorded it: the csrc/ headers only (CUTLASS, CUDA left out)
    kernel_header = csrc / inst.family.launch_header(inst.direction)
    deps = _ninja(graph, "-t", "deps", inst.stem + ".o")
    assert str(kernel_header) in deps
    assert all(p.startswith(str(csrc)) for p in re.findall(r"^    (\S+)$", deps, re.M)), deps
    assert str(kernel_header) not in _ninja(graph, "-t", "deps", "api.o")

    # an unchanged tree, and the same tree after setup.py rewrote the graph: nothing to do
    assert "no work to do" in _ninja(graph, "-n")
    compiled, out = _build(graph, gen, capsys)
    assert compiled == [] and "no work to do" in out, out

    # an isolated pip build: the same CUTLASS in a new directory, every header freshly written
    fresh = tmp_path / "site-packages" / "include"
    shutil.copytree(graph.find_toolchain().cutlass_include, fresh, copy_function=shutil.copy)
    identity = graph.cutlass_include()[1]
    monkeypatch.setattr(graph, "cutlass_include", lambda: (str(fresh), identity))
    compiled, out = _build(graph, gen, capsys)
    assert compiled == [] and "no work to do" in out, out

    # a header of a family this build lacks: nothing; a host header: the host objects only
    _touch(csrc / gen.FAMILY_BY_ARCH[90].launch_header("fwd"), graph)
    assert "no work to do" in _ninja(graph, "-n")
    kernel_mtime = (graph.KBUILD / (inst.stem + ".o")).stat().st_mtime_ns
    _touch(csrc / "dispatch" / "table.h", graph)
    compiled, out = _build(graph, gen, capsys)
    assert compiled == ["api.cpp", "dispatch_table.cpp"], out
    assert (graph.KBUILD / (inst.stem + ".o")).stat().st_mtime_ns == kernel_mtime

    # the kernel's own header: that kernel only, and the link
    _touch(kernel_header, graph)
    compiled, out = _build(graph, gen, capsys)
    assert compiled == [inst.filename], out
    assert re.search(rf"\] link {graph.LIB_FILE}", out), out
    assert "no work to do" in _ninja(graph, "-n")

    # a compile error: the failing file is named, with the tail of its log
    with open(csrc / "dispatch" / "validate.h", "a") as f:
        f.write("\n#error injected by test_build_graph\n")
    with pytest.raises(SystemExit, match=r"api\.cpp failed to build"):
        graph.build_library(gen)
    out = capsys.readouterr().out
    assert re.search(r"cutlass_flash: api\.cpp failed .*last \d+ lines of .*api\.log", out), out
    assert "#error injected by test_build_graph" in out


def test_ptxas_summary_reports_wgmma_serialization():
    # A kernel whose wgmma ptxas serializes (a wait after each) compiles without error and without
    # spills; the build's one line per file must still say so.
    spec = importlib.util.spec_from_file_location("nvcc_wrap", ROOT / "csrc" / "nvcc_wrap.py")
    wrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrap)
    log = "\n".join([
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'",
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions reading accumulator registers of  a wgmma in the function '_Z1kv'",
        "ptxas info    : Used 128 registers, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90a'",
        "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads",
        "ptxas info    : Used 168 registers",
    ])
    assert wrap.ptxas_summary(log) == "sm_90a: 168 regs, 8 B spill; C7514 x1"
    assert "C75" not in wrap.ptxas_summary(log.replace("(C7514) Potential Performance Loss", ""))
