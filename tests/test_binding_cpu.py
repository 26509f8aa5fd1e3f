"""The compiled binding's interface as the Python layer uses it, without a GPU: keyword names,
the kernel list, errors. Skipped when cutlass_flash._C is not built."""

import types

import pytest

import fake_c
import torch

import cutlass_flash
from cutlass_flash import _dispatch, _ops

pytestmark = pytest.mark.skipif(
    not isinstance(_dispatch._C, types.ModuleType),  # missing, or the test fake
    reason="cutlass_flash._C is not built (or CUTLASS_FLASH_TEST_FAKE_BINDING replaces it)",
)

NULL = (0, 0, 0, 0)


def _problem(head_dim=64, dtype="bf16"):
    q = torch.empty(2, 100, 4, head_dim)
    k = torch.empty(2, 50, 2, head_dim)
    return _ops._problem(q, k, head_dim, 0.125, -1, 0, dtype)


def test_built_kernels_format():
    built = _dispatch.lib().built_kernels()
    assert built, "the build has no kernels"
    for arch, direction, head_dim, dtype in built:
        assert arch in _dispatch.ARCHS
        assert direction in ("fwd", "bwd")
        assert head_dim in _dispatch.INSTANTIATED_HEAD_DIMS
        assert dtype in ("fp16", "bf16")
    assert cutlass_flash.built_kernels() == sorted(tuple(k) for k in built)


def _a_built_kernel(direction):
    return next(k for k in cutlass_flash.built_kernels() if k[1] == direction)


def test_workspace_bytes_takes_our_kwargs():
    C = _dispatch.lib()
    gen = fake_c._generator()
    for arch, direction, head_dim, dtype in cutlass_flash.built_kernels():
        p = _problem(head_dim, dtype)
        if direction == "fwd":
            # the sm90 forward needs its tile counter; the sm80 forward no scratch
            n = C.fwd_workspace_bytes(**p, arch=arch)
            assert isinstance(n, int) and n == (16 if arch == 90 else 0), (arch, n)
            continue
        # the backward's: the generator's table, which the C++ layout is written from; the dQ
        # groups' rule reads the keys and the mask's right edge
        for deterministic in (False, True):
            for seqlen_k in (p["seqlen_k"], gen.BWD_DQ_GROUPS_MIN_SEQLEN_K):
                for window_right in (-1, 0):
                    q = {**p, "seqlen_k": seqlen_k, "window_right": window_right}
                    n = C.bwd_workspace_bytes(**q, arch=arch, deterministic=deterministic)
                    assert n == gen.bwd_workspace_bytes(q["batch"], q["nheads"], q["seqlen_q"], seqlen_k, head_dim,
                                                        deterministic, window_right=window_right, arch=arch), \
                        (arch, deterministic, seqlen_k, window_right, n)


def test_fwd_and_bwd_take_our_kwargs():
    # Null pointers: the binding must reject them with ValueError, which also shows that the
    # keyword arguments the ops pass are the ones it expects (else TypeError).
    C = _dispatch.lib()
    arch, _, head_dim, dtype = _a_built_kernel("fwd")
    with pytest.raises(ValueError):
        C.fwd(NULL, NULL, NULL, NULL, 0, 0, **_problem(head_dim, dtype), arch=arch, stream=0)
    if any(k[1] == "bwd" for k in cutlass_flash.built_kernels()):
        arch, _, head_dim, dtype = _a_built_kernel("bwd")
        with pytest.raises(ValueError):
            C.bwd(NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0,
                  **_problem(head_dim, dtype), arch=arch, deterministic=False, stream=0)


def test_binding_rejects_bad_problems():
    C = _dispatch.lib()
    arch, _, head_dim, dtype = _a_built_kernel("fwd")
    # seqused without cu_seqlens: a dense batch has no slots to take rows of.
    for change in (dict(dtype="fp32"), dict(nheads_kv=3), dict(seqlen_q=0), dict(seqused_q=16), dict(seqused_k=16)):
        with pytest.raises(ValueError):
            C.bwd_workspace_bytes(**{**_problem(head_dim, dtype), **change}, arch=arch,
                                  deterministic=False)
        with pytest.raises(ValueError):
            C.fwd_workspace_bytes(**{**_problem(head_dim, dtype), **change}, arch=arch)


def test_binding_checks_head_dim_v():
    # A head dim of V of its own is taken only where the generator's HEAD_DIMS_V has a kernel for
    # it (the sm90 forward and backward at (192, 128)); elsewhere the host API refuses it before
    # any launch, rather than running a kernel that would read v and write out at the wrong width.
    from cutlass_flash._catalog import HEAD_DIMS_V

    C = _dispatch.lib()
    for arch, direction, head_dim, dtype in cutlass_flash.built_kernels():
        own = HEAD_DIMS_V[arch][direction].get(head_dim, ())
        for head_dim_v in (*own, 64 if 64 not in own and head_dim != 64 else 128):
            p = {**_problem(head_dim, dtype), "head_dim_v": head_dim_v}
            with pytest.raises(ValueError) as e:  # null pointers, if the problem passes
                if direction == "fwd":
                    C.fwd(NULL, NULL, NULL, NULL, 0, 0, **p, arch=arch, stream=0)
                else:
                    C.bwd(NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, **p, arch=arch, deterministic=False,
                          stream=0)
            assert ("head_dim_v" in str(e.value)) == (head_dim_v not in own), (arch, direction, head_dim,
                                                                                head_dim_v, e.value)
