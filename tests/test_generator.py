"""CPU checks of the build's instantiation generator (csrc/generate.py); no GPU, no build."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    name = "cutlass_flash_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "csrc" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def test_committed_generated_sources_match_generator(tmp_path):
    gen.write_generated(tmp_path)
    fresh = {p.name: p.read_bytes() for p in tmp_path.glob("*.cu")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "csrc" / "generated").glob("*.cu")}
    assert sorted(fresh) == sorted(committed), (
        "csrc/generated/ differs from the generator's file list; run `python csrc/generate.py`")
    stale = [n for n in fresh if fresh[n] != committed[n]]
    assert not stale, f"stale generated files {stale}; run `python csrc/generate.py`"


def test_full_set():
    insts = gen.all_instantiations()
    assert len(insts) == len({i.filename for i in insts})
    keys = {i.key for i in insts}
    for d in ("fwd", "bwd"):
        for hd in (64, 96, 128, 192, 256):
            for dt in ("fp16", "bf16"):
                assert (80, d, hd, dt) in keys
    text = gen.translation_unit(gen.Instantiation(80, "fwd", 128, "bf16"))
    assert ("template <>\nStatus run_fwd_kernel<80, 128, DType::kBFloat16>"
            "(const FwdParams& params, cudaStream_t stream)") in text
    assert "sm80::run_fwd<128, cutlass::bfloat16_t>(params, stream)" in text
    assert '#include "kernels/sm80/fwd_launch.h"' in text


def test_default_selection():
    knobs = gen.Knobs.from_env({})
    assert 80 in knobs.archs
    insts = [i for i in gen.select(knobs) if i.arch == 80]
    assert len(insts) == 20
    for i in insts:
        assert i.gencode == ("-gencode", "arch=compute_80,code=sm_80",
                             "-gencode", "arch=compute_90,code=sm_90")
        assert i.source == ROOT / "csrc" / "generated" / i.filename


def test_default_selection_has_hopper_forward_and_backward():
    insts = [i for i in gen.select(gen.Knobs.from_env({})) if i.arch == 90]
    assert sorted((i.direction, i.head_dim, i.dtype) for i in insts) == sorted(
        (direction, hd, dt) for direction in ("fwd", "bwd") for hd in (64, 96, 128, 192, 256)
        for dt in ("fp16", "bf16"))
    for i in insts:  # wgmma and setmaxnreg exist only in sm_90a
        assert i.gencode == ("-gencode", "arch=compute_90a,code=sm_90a")
    text = gen.translation_unit(gen.Instantiation(90, "fwd", 64, "fp16"))
    assert "sm90::run_fwd<64, cutlass::half_t>(params, stream)" in text


def test_python_catalog_is_the_generators():
    from cutlass_flash import _catalog, _dispatch

    assert (ROOT / "cutlass_flash" / "_catalog.py").read_text() == gen.python_catalog()
    assert _catalog.FAMILIES == {f.arch: {d: f.head_dims_for(d) for d in f.directions}
                                 for f in gen.FAMILIES}
    assert _dispatch.FAMILY_DIRECTIONS == {f.arch: tuple(f.directions) for f in gen.FAMILIES}
    assert set(_dispatch.ARCHS) == {f.arch for f in gen.FAMILIES}


def test_dropout_constants_are_the_generators():
    """Dropout's mask function has one set of constants: the kernels' header and the torch twin
    (cutlass_flash.dropout, through _catalog) read the generator's."""
    from cutlass_flash import _catalog, dropout

    assert (ROOT / "csrc" / "generated" / gen.DROPOUT_HEADER).read_text() == gen.dropout_header()
    assert f"kPhiloxRounds = {gen.DROPOUT_PHILOX_ROUNDS};" in gen.dropout_header()
    assert _catalog.DROPOUT_PHILOX_ROUNDS == gen.DROPOUT_PHILOX_ROUNDS == dropout.ROUNDS


def test_backward_workspace_table():
    """The generated C++ layout and the Python size come from one table and agree."""
    assert (ROOT / "csrc" / "generated" / gen.BWD_WORKSPACE_HEADER).read_text() == \
        gen.bwd_workspace_header()
    # batch 2, 16 heads, 1000 rows -> 1024 rounded: dQ 128 floats + D + LSE per row, and one
    # semaphore per 64 rows when deterministic.
    rows = 2 * 16 * 1024
    long_k = gen.BWD_DQ_GROUPS_MIN_SEQLEN_K
    assert gen.bwd_workspace_bytes(2, 16, 1000, long_k, 128, False) == rows * 130 * 4
    # Deterministic: one dQ copy (BWD_DQ_GROUPS: more would take the mode past 1.25x the
    # default's memory) and one semaphore per 64 rows, at any number of keys, masked or not.
    assert gen.BWD_DQ_GROUPS == 1
    for head_dim in (64, 128, 256):
        bounded = gen.BWD_DQ_GROUPS_MIN_SEQLEN_K_RIGHT_BOUNDED
        for seqlen_k, window_right in ((long_k, -1), (long_k - 1, -1), (bounded, 0)):
            det = gen.bwd_workspace_bytes(2, 16, 1000, seqlen_k, head_dim, True, window_right=window_right)
            default = gen.bwd_workspace_bytes(2, 16, 1000, seqlen_k, head_dim, False, window_right=window_right)
            assert det == rows * (head_dim + 2) * 4 + rows // 64 * 4
            assert det <= 1.01 * default
            assert gen.bwd_dq_groups(seqlen_k, True, window_right) == 1


def test_restricted_selection():
    env = {"CUTLASS_FLASH_ARCHS": "80", "CUTLASS_FLASH_HEAD_DIMS": "128, 64",
           "CUTLASS_FLASH_DTYPES": "bf16",
           "CUTLASS_FLASH_FWD_ONLY": "1", "CUTLASS_FLASH_SM80_SASS": "sm_80"}
    knobs = gen.Knobs.from_env(env)
    assert knobs.head_dims == (64, 128) and knobs.dtypes == ("bf16",) and knobs.fwd_only
    insts = gen.select(knobs)
    assert [i.filename for i in insts] == ["fwd_sm80_hdim64_bf16.cu", "fwd_sm80_hdim128_bf16.cu"]
    assert all(i.gencode == ("-gencode", "arch=compute_80,code=sm_80") for i in insts)

    table = gen.dispatch_table_source(insts, knobs)
    assert "run_fwd_kernel<80, 64, DType::kBFloat16>" in table
    assert "run_fwd_kernel<80, 128, DType::kBFloat16>" in table
    assert "run_bwd_kernel" not in table and "kFloat16}" not in table
    # the specializations are declared before the table that takes their addresses
    assert table.index("template <> Status run_fwd_kernel<80, 64") < table.index("kEntries[]")
    assert '{"CUTLASS_FLASH_HEAD_DIMS", "64,128"}' in table


def test_empty_values_mean_default():
    assert gen.Knobs.from_env({"CUTLASS_FLASH_HEAD_DIMS": "", "CUTLASS_FLASH_DTYPES": " "}) == \
        gen.Knobs.from_env({})
    assert gen.Knobs.from_env({"CUTLASS_FLASH_HEAD_DIMS": "all"}).head_dims == gen.HEAD_DIMS


@pytest.mark.parametrize("env, match", [
    ({"CUTLASS_FLASH_HEAD_DIMS": "80"}, "80 is not a known head dim"),
    ({"CUTLASS_FLASH_HEAD_DIMS": "64,x"}, "'x' is not an integer"),
    ({"CUTLASS_FLASH_HEAD_DIMS": ","}, "empty list"),
    ({"CUTLASS_FLASH_ARCHS": "70"}, "70 is not a known kernel family"),
    ({"CUTLASS_FLASH_DTYPES": "fp32"}, "'fp32' is not a known dtype"),
    ({"CUTLASS_FLASH_FWD_ONLY": "maybe"}, "CUTLASS_FLASH_FWD_ONLY"),
    ({"CUTLASS_FLASH_SM80_SASS": "75"}, "'75' is not a SASS target"),
    ({"CUTLASS_FLASH_SM80_SASS": "90a"}, "'90a' is not a SASS target"),
])
def test_bad_knob_raises(env, match):
    with pytest.raises(gen.KnobError, match=match):
        gen.Knobs.from_env(env)
    with pytest.raises(ValueError):   # KnobError is a ValueError
        gen.Knobs.from_env(env)


def test_write_generated_is_idempotent_and_prunes(tmp_path):
    # One translation unit per instantiation, the workspace header and dropout's constants.
    assert len(gen.write_generated(tmp_path)) == len(gen.all_instantiations()) + 2
    assert gen.write_generated(tmp_path) == []       # unchanged text: nothing rewritten
    stale = tmp_path / "fwd_sm80_hdim48_bf16.cu"
    stale.write_text(gen.MARKER + "\n")
    keep = tmp_path / "hand_written.cu"
    keep.write_text("// not generated\n")
    assert gen.write_generated(tmp_path) == [stale]
    assert not stale.exists() and keep.exists()
