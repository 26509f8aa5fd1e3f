"""Dispatch logic on CPU: head-dim padding, kernel family choice, force_arch and its environment
variable, the error when a kernel is not built, the import without a GPU or binding."""

import os
import subprocess
import sys

import pytest
import torch

import cutlass_flash
from cutlass_flash import _dispatch, flash_attn_func

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(cutlass_flash.__file__)))

# Every valid head dim and the instantiated head dim it is padded to.
PADDING_TABLE = {d: (64 if d <= 64 else 96 if d <= 96 else 128 if d <= 128 else 192 if d <= 192
                     else 256) for d in range(1, 257)}


@pytest.mark.parametrize("head_dim", sorted(PADDING_TABLE))
def test_padded_head_dim(head_dim):
    assert cutlass_flash.padded_head_dim(head_dim) == PADDING_TABLE[head_dim]
    assert cutlass_flash.padded_head_dim(head_dim) in cutlass_flash.INSTANTIATED_HEAD_DIMS


@pytest.mark.parametrize("head_dim", [0, -8, 257, 264, 512])
def test_padded_head_dim_rejects(head_dim):
    with pytest.raises(ValueError, match="between 1 and 256"):
        cutlass_flash.padded_head_dim(head_dim)


def _qkv(b=2, sq=16, sk=24, h=4, hkv=2, d=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=g).to(dtype),
            torch.randn(b, sk, hkv, d, generator=g).to(dtype),
            torch.randn(b, sk, hkv, d, generator=g).to(dtype))


# -- kernel family selection ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "cap,requested,built_archs,expected",
    [
        ((9, 0), 0, (80, 90), 90),   # auto on sm90 with sm90 kernels
        ((9, 0), 0, (80,), 80),      # auto on sm90 without them
        ((8, 0), 0, (80, 90), 80),   # auto on sm80
        ((8, 6), 0, (80, 90), 80),
        ((8, 9), 0, (80, 90), 80),
        ((9, 0), 80, (80, 90), 80),  # forced
        ((9, 0), 90, (80, 90), 90),
    ],
)
def test_resolve_arch(fake_backend, cap, requested, built_archs, expected):
    fake_backend.set_capability(cap)
    fake_backend.set_built([k for k in fake_backend.built if k[0] in built_archs])
    for direction in ("fwd", "bwd"):
        got = _dispatch.resolve_arch(requested, direction, 128, "bf16", torch.device("cpu"))
        assert got == expected


@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (12, 0)])
@pytest.mark.parametrize("arch", [0, 80, 90])
def test_blackwell_is_refused_before_any_launch(fake_backend, cap, arch):
    fake_backend.set_capability(cap)
    q, k, v = _qkv()
    with cutlass_flash.force_arch(arch), pytest.raises(
            NotImplementedError, match=rf"Fake GPU, sm{cap[0]}{cap[1]}\) is not supported yet"):
        flash_attn_func(q, k, v)
    assert fake_backend.calls == []


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9)])
def test_forcing_sm90_needs_sm90(fake_backend, cap):
    fake_backend.set_capability(cap)
    q, k, v = _qkv()
    with cutlass_flash.force_arch(90), pytest.raises(RuntimeError, match="needs an sm90 GPU"):
        flash_attn_func(q, k, v)


def test_resolve_arch_rejects_unknown_family(fake_backend):
    with pytest.raises(ValueError, match="arch must be"):
        _dispatch.resolve_arch(70, "fwd", 64, "fp16", torch.device("cpu"))
    with pytest.raises(ValueError):
        torch.ops.cutlass_flash.fwd(*_qkv(), 0.1, -1, -1, 75, False)


@pytest.mark.parametrize("arch", [80, 90])
def test_auto_and_forced_arch_reach_the_binding(fake_backend, arch):
    q, k, v = (t.requires_grad_() for t in _qkv())
    with cutlass_flash.force_arch(arch):
        out = flash_attn_func(q, k, v, causal=True)
    # The backward runs outside the context and still uses the family of its forward.
    out.sum().backward()
    assert fake_backend.archs_called() == [arch, arch]
    fake_backend.calls.clear()
    flash_attn_func(q, k, v).sum().backward()
    assert fake_backend.archs_called() == [90, 90]  # auto on the fake sm90


def test_auto_falls_back_per_direction(fake_backend):
    # sm90 forward built, sm90 backward not: auto runs fwd on 90 and bwd on 80.
    fake_backend.set_built([k for k in fake_backend.built if not (k[0] == 90 and k[1] == "bwd")])
    q, k, v = (t.requires_grad_() for t in _qkv())
    flash_attn_func(q, k, v).sum().backward()
    assert fake_backend.archs_called("fwd") == [90]
    assert fake_backend.archs_called("bwd") == [80]


def test_padded_head_dim_reaches_binding(fake_backend):
    q, k, v = (t.requires_grad_() for t in _qkv(d=40))
    out = flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.is_contiguous()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert [c[2]["head_dim"] for c in fake_backend.calls] == [64, 64]
    # The softmax scale comes from the original head dim.
    assert [c[2]["softmax_scale"] for c in fake_backend.calls] == [40 ** -0.5] * 2


def test_problem_kwargs(fake_backend):
    q, k, v = _qkv(b=3, sq=5, sk=7, h=6, hkv=2, d=128)
    flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    (direction, arch, kw), = fake_backend.calls
    assert direction == "fwd"
    assert kw == dict(batch=3, seqlen_q=5, seqlen_k=7, nheads=6, nheads_kv=2, head_dim=128,
                      softmax_scale=0.3, window_left=-1, window_right=0, softcap=0.0, dtype="bf16",
                      arch=90)
    fake_backend.calls.clear()
    flash_attn_func(q.half(), k.half(), v.half())
    kw = fake_backend.calls[0][2]
    assert (kw["window_left"], kw["window_right"], kw["dtype"]) == (-1, -1, "fp16")
    # Dropout: its probability and a fresh 16-byte-aligned (seed, offset) per call.
    fake_backend.calls.clear()
    flash_attn_func(q, k, v, dropout_p=0.25)
    kw = fake_backend.calls[0][2]
    assert kw["dropout_p"] == 0.25 and kw["rng_state"] != 0 and kw["rng_state"] % 16 == 0


# -- kernels missing from the build ---------------------------------------------------------------

@pytest.mark.parametrize("arch", [0, 80, 90])
def test_not_built_raises_not_implemented(fake_backend, arch):
    fake_backend.set_built([k for k in fake_backend.built if k[2:] != (128, "bf16")])
    q, k, v = _qkv(d=128)
    with cutlass_flash.force_arch(arch), pytest.raises(NotImplementedError) as info:
        flash_attn_func(q, k, v)
    msg = str(info.value)
    assert "head_dim=128" in msg and "bf16" in msg and "Rebuild" in msg, msg
    assert fake_backend.calls == []
    # Other head dims still work (padding to 96 for 72).
    flash_attn_func(*_qkv(d=72))
    assert fake_backend.calls[-1][2]["head_dim"] == 96


def test_built_kernels_lists_the_build(fake_backend):
    fake_backend.set_built([(80, "fwd", 64, "fp16"), (90, "bwd", 128, "bf16")])
    assert cutlass_flash.built_kernels() == [(80, "fwd", 64, "fp16"), (90, "bwd", 128, "bf16")]


def test_missing_extension_raises_import_error(fake_backend, monkeypatch):
    monkeypatch.setattr(_dispatch, "_C", None)
    _dispatch.reset_caches()
    with pytest.raises(ImportError, match="pip install"):
        flash_attn_func(*_qkv())
    with pytest.raises(ImportError, match="cutlass_flash._C"):
        cutlass_flash.built_kernels()
    assert "cutlass_flash._C" in cutlass_flash.extension_error()


# -- force_arch and CUTLASS_FLASH_FORCE_ARCH -----------------------------------------------------

def test_force_arch_context_and_call(fake_backend):
    assert cutlass_flash.forced_arch() == 0
    with cutlass_flash.force_arch(80):
        assert cutlass_flash.forced_arch() == 80
        with cutlass_flash.force_arch("sm90"):
            assert cutlass_flash.forced_arch() == 90
        assert cutlass_flash.forced_arch() == 80
        with cutlass_flash.force_arch("auto"):
            assert cutlass_flash.forced_arch() == 0
        assert cutlass_flash.forced_arch() == 80
    assert cutlass_flash.forced_arch() == 0
    cutlass_flash.force_arch(90)  # plain call: stays in effect
    assert cutlass_flash.forced_arch() == 90
    cutlass_flash.force_arch(None)
    assert cutlass_flash.forced_arch() == 0


@pytest.mark.parametrize("bad", [70, 100, "sm75", "fast"])
def test_force_arch_rejects(bad):
    before = cutlass_flash.forced_arch()
    with pytest.raises(ValueError, match="80, 90"):
        cutlass_flash.force_arch(bad)
    assert cutlass_flash.forced_arch() == before


@pytest.mark.parametrize("value,expected", [(None, 0), ("", 0), ("auto", 0), ("0", 0),
                                            ("80", 80), ("90", 90), ("sm80", 80), (" SM90 ", 90)])
def test_arch_from_env(value, expected):
    env = {} if value is None else {_dispatch.ENV_FORCE_ARCH: value}
    assert _dispatch.arch_from_env(env) == expected


def test_arch_from_env_rejects():
    with pytest.raises(ValueError, match="CUTLASS_FLASH_FORCE_ARCH"):
        _dispatch.arch_from_env({_dispatch.ENV_FORCE_ARCH: "75"})


def _run_python(code, **env):
    full_env = dict(os.environ)
    full_env.pop(_dispatch.ENV_FORCE_ARCH, None)
    full_env.update(env)
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=300)


def test_env_var_sets_the_initial_arch():
    r = _run_python("import cutlass_flash; print(cutlass_flash.forced_arch())",
                    CUTLASS_FLASH_FORCE_ARCH="80")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "80"


def test_import_without_gpu():
    # No visible GPU (and here maybe no driver at all): the import works, the op is registered.
    code = (
        "import torch, cutlass_flash\n"
        "assert callable(cutlass_flash.flash_attn_func)\n"
        "assert hasattr(torch.ops.cutlass_flash, 'fwd')\n"
        "assert hasattr(torch.ops.cutlass_flash, 'bwd')\n"
        "print(torch.cuda.is_available(), cutlass_flash.__version__)\n"
    )
    r = _run_python(code, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("False ")
