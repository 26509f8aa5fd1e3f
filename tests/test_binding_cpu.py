"""The compiled binding's interface as the Python layer uses it, without a GPU: keyword names,
the kernel list, errors. Skipped when cutlass_flash._C is not built."""

import types

import pytest
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
    for arch, direction, head_dim, dtype in cutlass_flash.built_kernels():
        n = getattr(C, f"{direction}_workspace_bytes")(**_problem(head_dim, dtype), arch=arch)
        # the sm90 forward needs its tile counter; the sm80 forward no scratch; backward its
        # dQ accumulator
        expected = (lambda n: n == 16) if (arch, direction) == (90, "fwd") else (
            (lambda n: n == 0) if direction == "fwd" else (lambda n: n > 0))
        assert isinstance(n, int) and expected(n), (arch, direction, n)


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
                  **_problem(head_dim, dtype), arch=arch, stream=0)


def test_binding_rejects_bad_problems():
    C = _dispatch.lib()
    arch, _, head_dim, dtype = _a_built_kernel("fwd")
    for change in (dict(dtype="fp32"), dict(nheads_kv=3), dict(seqlen_q=0)):
        with pytest.raises(ValueError):
            C.bwd_workspace_bytes(**{**_problem(head_dim, dtype), **change}, arch=arch)
        with pytest.raises(ValueError):
            C.fwd_workspace_bytes(**{**_problem(head_dim, dtype), **change}, arch=arch)
