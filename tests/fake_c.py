"""A stand-in for the compiled module cutlass_flash._C that runs on CPU tensors.

It has the binding's interface (raw pointers and element strides) and computes attention with the
float64 reference, reading and writing the caller's memory through the pointers. It checks what
the real binding relies on (alignment, instantiated head dims, built kernels, workspace size) and
records every call, so the CPU tests exercise the Python layer end to end: marshalling, padding,
GQA reduction, dispatch, autograd and torch.compile.
"""

import ctypes

import torch

from attn_ref import attention_ref, window_mask

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _generator():
    """csrc/generate.py, the source of the backward workspace table the C++ layout is written
    from."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "cutlass_flash_generate"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "csrc" / "generate.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
from cutlass_flash._catalog import DTYPES as DTYPE_NAMES, FAMILIES, FWD_WORKSPACE_ALIGN, FWD_WORKSPACE_BYTES
from cutlass_flash._catalog import HEAD_DIMS as INSTANTIATED


def all_kernels(archs=tuple(FAMILIES), head_dims=INSTANTIATED, dtypes=DTYPE_NAMES):
    return [
        (a, d, h, t)
        for a in archs for d, dims in FAMILIES[a].items() for h in head_dims if h in dims
        for t in dtypes
    ]


class _CudaMemory:
    """Exposes raw CUDA memory to torch.as_tensor (the CUDA array interface), without copying."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def _raw(ptr, shape, strides, dtype, device="cpu"):
    """A tensor of `shape`/`strides` (elements) aliasing the memory at `ptr`."""
    assert ptr, "null pointer"
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    nbytes = extent * itemsize
    if torch.device(device).type == "cuda":
        flat = torch.as_tensor(_CudaMemory(ptr, nbytes), device=device).view(dtype)
    else:
        buf = (ctypes.c_char * nbytes).from_address(ptr)
        flat = torch.frombuffer(buf, dtype=dtype, count=extent)
    return flat.as_strided(shape, strides)


class FakeC:
    """The binding's interface over CPU memory (device="cpu", the CPU tests) or CUDA memory
    (device="cuda": CUTLASS_FLASH_TEST_FAKE_BINDING=1 runs the GPU tests against it, which tests
    the test harness, not the kernels)."""

    def __init__(self, built=None, device="cpu"):
        self.built = list(all_kernels() if built is None else built)
        self.device = device
        self.calls = []  # (direction, arch, problem dict)

    # -- the binding's interface --------------------------------------------------------------
    def built_kernels(self):
        return list(self.built)

    def bwd_workspace_bytes(self, deterministic, **kw):
        p = self._problem("bwd", kw, check_built=False)
        assert isinstance(deterministic, bool)
        return _generator().bwd_workspace_bytes(
            p["batch"], p["nheads"], p["seqlen_q"], p["seqlen_k"], p["head_dim"], deterministic
        )

    def fwd_workspace_bytes(self, **kw):
        p = self._problem("fwd", kw, check_built=False)
        return FWD_WORKSPACE_BYTES[p["arch"]]

    def fwd(self, q, k, v, o, lse_ptr, workspace_ptr, **kw):
        p = self._problem("fwd", kw)
        if FWD_WORKSPACE_BYTES[p["arch"]]:
            assert workspace_ptr % FWD_WORKSPACE_ALIGN == 0 and workspace_ptr != 0, "workspace must be aligned"
        dtype = DTYPES[p["dtype"]]
        Q, K, V, Out = self._tensors(p, dtype, q=q, k=k, v=v, o=o)
        assert lse_ptr % 16 == 0
        lse = _raw(lse_ptr, (p["batch"], p["nheads"], p["seqlen_q"]),
                   (p["nheads"] * p["seqlen_q"], p["seqlen_q"], 1), torch.float32, self.device)
        out, lse_ref = attention_ref(
            Q.double(), K.double(), V.double(), softmax_scale=p["softmax_scale"],
            window=(p["window_left"], p["window_right"]), softcap=p["softcap"],
        )
        Out.copy_(out)
        lse.copy_(lse_ref)

    def bwd(self, q, k, v, o, dout, lse_ptr, dq, dk, dv, workspace_ptr, deterministic, **kw):
        p = self._problem("bwd", kw)
        assert isinstance(deterministic, bool)
        dtype = DTYPES[p["dtype"]]
        Q, K, V, O, dO, dQ, dK, dV = self._tensors(
            p, dtype, q=q, k=k, v=v, o=o, dout=dout, dq=dq, dk=dk, dv=dv
        )
        assert lse_ptr % 16 == 0
        lse = _raw(lse_ptr, (p["batch"], p["nheads"], p["seqlen_q"]),
                   (p["nheads"] * p["seqlen_q"], p["seqlen_q"], 1), torch.float32, self.device)
        # The CUDA caching allocator gives 512-byte alignment; the CPU allocator 64 bytes.
        assert workspace_ptr % 64 == 0 and workspace_ptr != 0, "workspace must be aligned"
        group = p["nheads"] // p["nheads_kv"]
        # dK/dV per kv head: the gradients with respect to K and V expanded to nheads, then summed
        # over each group, written out by hand (the op runs below autograd, so no autograd here).
        scale = p["softmax_scale"]
        q64 = Q.double()
        k64 = K.double().repeat_interleave(group, dim=2)
        v64 = V.double().repeat_interleave(group, dim=2)
        do64 = dO.double()
        # As the kernels: P from the LSE the caller passes (exp(scale * s - lse), 0 where masked
        # or where the row sees no key, lse = +inf) and D = rowsum(dO * O) from the O it passes,
        # so an LSE and O computed elsewhere (ring attention) are used as given.
        window = (p["window_left"], p["window_right"])
        scores = torch.einsum("bthd,bshd->bhts", q64 * scale, k64)
        cap = p["softcap"]
        if cap > 0:  # the gradient of x = scale * s goes through tanh: dx = ds * (1 - t^2)
            t = torch.tanh(scores / cap)
            scores = cap * t
        if window[0] >= 0 or window[1] >= 0:
            allowed = window_mask(p["seqlen_q"], p["seqlen_k"], window[0], window[1], q64.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.exp(scores - lse.double().unsqueeze(-1))
        probs = probs.nan_to_num(nan=0.0)  # -inf - (+inf) rows: no key
        gv = torch.einsum("bhts,bthd->bshd", probs, do64)
        dp = torch.einsum("bthd,bshd->bhts", do64, v64)
        d_row = (do64 * O.double()).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, t, 1)
        ds = probs * (dp - d_row)
        if cap > 0:
            ds = ds * (1 - t * t)
        gq = torch.einsum("bhts,bshd->bthd", ds, k64) * scale
        gk = torch.einsum("bhts,bthd->bshd", ds, q64) * scale
        B, Sk, H, D = gk.shape
        dQ.copy_(gq)
        dK.copy_(gk.view(B, Sk, H // group, group, D).sum(3))
        dV.copy_(gv.view(B, Sk, H // group, group, D).sum(3))

    # -- checks ---------------------------------------------------------------------------------
    _KEYS = ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "head_dim", "softmax_scale",
             "window_left", "window_right", "softcap", "dtype", "arch")

    def _problem(self, direction, kw, check_built=True):
        kw = dict(kw)
        stream = kw.pop("stream", 0)
        assert isinstance(stream, int), f"stream must be an int, got {type(stream)}"
        assert set(kw) == set(self._KEYS), f"unexpected kwargs {sorted(kw)}"
        if kw["head_dim"] not in INSTANTIATED:
            raise ValueError(f"head_dim {kw['head_dim']} is not instantiated")
        if kw["dtype"] not in DTYPES:
            raise ValueError(f"bad dtype {kw['dtype']!r}")
        if kw["nheads"] % kw["nheads_kv"]:
            raise ValueError("nheads must be a multiple of nheads_kv")
        assert isinstance(kw["softmax_scale"], float)
        assert isinstance(kw["softcap"], float) and kw["softcap"] >= 0
        key = (kw["arch"], direction, kw["head_dim"], kw["dtype"])
        if check_built:
            if key not in self.built:
                raise NotImplementedError(f"fake _C: kernel {key} not built")
            self.calls.append((direction, kw["arch"], kw))
        return kw

    def _tensors(self, p, dtype, **refs):
        B, Sq, Sk = p["batch"], p["seqlen_q"], p["seqlen_k"]
        H, Hkv, D = p["nheads"], p["nheads_kv"], p["head_dim"]
        shapes = {
            "q": (B, Sq, H, D), "o": (B, Sq, H, D), "dout": (B, Sq, H, D), "dq": (B, Sq, H, D),
            "k": (B, Sk, Hkv, D), "v": (B, Sk, Hkv, D),
            "dk": (B, Sk, Hkv, D), "dv": (B, Sk, Hkv, D),
        }
        out = []
        for name, ref in refs.items():
            assert isinstance(ref, tuple) and len(ref) == 4, f"{name}: bad ref {ref!r}"
            ptr, *strides = ref
            assert ptr % 16 == 0, f"{name}: pointer not 16-byte aligned"
            for n, s in zip(shapes[name][:3], strides):
                assert n == 1 or s % 8 == 0, f"{name}: stride {s} not a multiple of 8"
            out.append(_raw(ptr, shapes[name], (*strides, 1), dtype, self.device))
        return out

    def archs_called(self, direction=None):
        return [a for d, a, _ in self.calls if direction is None or d == direction]
