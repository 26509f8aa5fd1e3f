"""A stand-in for the compiled module cutlass_flash._C that runs on CPU tensors.

It has the binding's interface (raw pointers and element strides) and computes attention with the
float64 reference, reading and writing the caller's memory through the pointers. It checks what
the real binding relies on (alignment, instantiated head dims, built kernels, workspace size) and
records every call, so the CPU tests exercise the Python layer end to end: marshalling, padding,
GQA reduction, dispatch, autograd and torch.compile.
"""

import ctypes

import torch

from attn_ref import alibi_bias, attention_ref, window_mask
from cutlass_flash.dropout import keep_mask, keep_scale

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
from cutlass_flash._catalog import DTYPES as DTYPE_NAMES, FAMILIES, FWD_WORKSPACE_ALIGN, FWD_WORKSPACE_BYTES  # noqa: E402
from cutlass_flash._catalog import HEAD_DIMS as INSTANTIATED, HEAD_DIMS_V, NARROW_HEAD_DIM, SOFTCAP_ALIBI, VARLEN  # noqa: E402


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
            p["batch"], p["nheads"], p["seqlen_q"], p["seqlen_k"], p["head_dim"], deterministic,
            total_q=p["total_q"] if p["cu_seqlens_q"] else None, window_right=p["window_right"], arch=p["arch"],
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
        lse = self._lse(p, lse_ptr)
        keep_all = self._keep(p)
        for b, (sq, sk, lse_b) in enumerate(self._sequences(p, lse)):
            keep = self._sequence_keep(p, keep_all, b, Q[sq].shape[1], K[sk].shape[1])
            sinks = self._sinks(p)
            if K[sk].shape[1] == 0:  # a sequence without keys: its rows see none (or only the sink)
                Out[sq].zero_()
                lse_b.copy_(sinks.view(1, -1, 1).expand_as(lse_b) if sinks is not None else float("inf"))
                continue
            out, lse_ref = attention_ref(
                Q[sq].double(), K[sk].double(), V[sk].double(), softmax_scale=p["softmax_scale"],
                window=(p["window_left"], p["window_right"]), softcap=p["softcap"],
                alibi_slopes=self._slopes(p, b), dropout_p=p["dropout_p"], keep=keep, sinks=sinks,
            )
            Out[sq].copy_(out)
            lse_b.copy_(lse_ref)
        self._padding(p, (Out,), (), lse)

    def bwd(self, q, k, v, o, dout, lse_ptr, dq, dk, dv, workspace_ptr, deterministic, dsink_rows_ptr=0, **kw):
        p = self._problem("bwd", kw)
        if dsink_rows_ptr:
            assert p["sinks"], "dsink_rows needs sinks"
            # Each row's share of dsinks, -exp(sink - lse) * rowsum(dout * out), laid out as lse.
            sinks = self._sinks(p).view(1, -1, 1).double()
            lse_all, rows = self._lse(p, lse_ptr), self._lse(p, dsink_rows_ptr)
            Oa, dOa = self._tensors(p, DTYPES[p["dtype"]], o=o, dout=dout)
            for sq, _, lse_b in self._sequences(p, lse_all):
                d_row = (dOa[sq].double() * Oa[sq].double()).sum(-1).transpose(1, 2)
                r = slice(None) if sq == slice(None) else sq[1]
                rows[:, :, r] = (-torch.exp(sinks - lse_b.double()) * d_row).float()
        assert isinstance(deterministic, bool)
        dtype = DTYPES[p["dtype"]]
        Q, K, V, O, dO, dQ, dK, dV = self._tensors(
            p, dtype, q=q, k=k, v=v, o=o, dout=dout, dq=dq, dk=dk, dv=dv
        )
        assert lse_ptr % 16 == 0
        lse = self._lse(p, lse_ptr)
        # The CUDA caching allocator gives 512-byte alignment; the CPU allocator 64 bytes.
        assert workspace_ptr % 64 == 0 and workspace_ptr != 0, "workspace must be aligned"
        keep_all = self._keep(p)
        for b, (sq, sk, lse_b) in enumerate(self._sequences(p, lse)):
            if K[sk].shape[1] == 0 or Q[sq].shape[1] == 0:  # nothing attends: zero gradients
                dQ[sq].zero_()
                dK[sk].zero_()
                dV[sk].zero_()
                continue
            keep = self._sequence_keep(p, keep_all, b, Q[sq].shape[1], K[sk].shape[1])
            gq, gk, gv = self._grads(p, Q[sq], K[sk], V[sk], O[sq], dO[sq], lse_b, self._slopes(p, b), keep)
            dQ[sq].copy_(gq)
            dK[sk].copy_(gk)
            dV[sk].copy_(gv)
        self._padding(p, (dQ,), (dK, dV))

    def _slopes(self, p, sequence):
        """The ALiBi slopes the kernels read, (batch, nheads) (a dense batch) or (1, nheads) (one
        sequence of a variable-length batch); None when off."""
        if not p["alibi_slopes"]:
            return None
        B, H = p["batch"], p["nheads"]
        slopes = _raw(p["alibi_slopes"], (B, H), (p["alibi_batch_stride"], 1), torch.float32, self.device)
        return slopes[sequence:sequence + 1] if p["cu_seqlens_q"] else slopes

    def _keep(self, p):
        """Dropout's mask of the call, (batch, nheads, seqlen_q, seqlen_k) (the longest lengths
        when packed), as the kernels draw it from the rng_state they read; None when off."""
        if not p["dropout_p"]:
            return None
        rng_state = _raw(p["rng_state"], (2,), (1,), torch.int64, self.device)
        return keep_mask(rng_state, p["batch"], p["nheads"], p["seqlen_q"], p["seqlen_k"], p["dropout_p"])

    @staticmethod
    def _sequence_keep(p, keep, sequence, seqlen_q, seqlen_k):
        """A sequence's corner of the call's mask (all of it when dense)."""
        if keep is None or not p["cu_seqlens_q"]:
            return keep
        return keep[sequence:sequence + 1, :, :seqlen_q, :seqlen_k]

    @staticmethod
    def _grads(p, Q, K, V, O, dO, lse, slopes=None, keep=None):
        """Gradients of one (batch, seqlen, heads, d) problem, by hand (the op runs below
        autograd)."""
        group = p["nheads"] // p["nheads_kv"]
        # dK/dV per kv head: the gradients with respect to K and V expanded to nheads, then summed
        # over each group.
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
        if slopes is not None:
            B, Sq, H, _ = Q.shape
            scores = scores + alibi_bias(slopes, B, H, Sq, K.shape[1], q64.device, scores.dtype)
        if window[0] >= 0 or window[1] >= 0:
            allowed = window_mask(Q.shape[1], K.shape[1], window[0], window[1], q64.device)
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.exp(scores - lse.double().unsqueeze(-1))
        probs = probs.nan_to_num(nan=0.0)  # -inf - (+inf) rows: no key
        # Dropout: O = (P * keep * scale) V (scale: 1 / the keep rate), so dV takes the dropped P
        # and dP is masked alike.
        drop = 1.0 if keep is None else keep.double() * keep_scale(p["dropout_p"])
        gv = torch.einsum("bhts,bthd->bshd", probs * drop, do64)
        dp = torch.einsum("bthd,bshd->bhts", do64, v64) * drop
        d_row = (do64 * O.double()).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, t, 1)
        ds = probs * (dp - d_row)
        if cap > 0:
            ds = ds * (1 - t * t)
        gq = torch.einsum("bhts,bshd->bthd", ds, k64) * scale
        gk = torch.einsum("bhts,bthd->bshd", ds, q64) * scale
        B, Sk, H, D = gk.shape
        return (gq, gk.view(B, Sk, H // group, group, D).sum(3),
                gv.view(B, Sk, H // group, group, gv.shape[-1]).sum(3))

    def _sinks(self, p):
        """The float32 (nheads,) sink logits the kernels read; None when off."""
        return _raw(p["sinks"], (p["nheads"],), (1,), torch.float32, self.device) if p["sinks"] else None

    def _lse(self, p, ptr):
        """The LSE the kernels read or write: (batch, nheads, seqlen_q), or (1, nheads,
        total_q) for a variable-length batch (FlashAttention-2's (nheads, total_q))."""
        if p["cu_seqlens_q"]:
            H, T = p["nheads"], p["total_q"]
            return _raw(ptr, (1, H, T), (H * T, T, 1), torch.float32, self.device)
        B, H, S = p["batch"], p["nheads"], p["seqlen_q"]
        return _raw(ptr, (B, H, S), (H * S, S, 1), torch.float32, self.device)

    def _rows(self, p):
        """Per side (query, key): each sequence's (first row, end row, slot end) of a
        variable-length batch, clamped to the tensors as the kernels clamp (SeqInfo), seqused
        applied; and the first row after the last slot."""
        n = p["batch"] + 1
        sides = []
        for side, total, longest in (("q", p["total_q"], p["seqlen_q"]), ("k", p["total_k"], p["seqlen_k"])):
            cu = _raw(p[f"cu_seqlens_{side}"], (n,), (1,), torch.int32, self.device).tolist()
            used = p[f"seqused_{side}"]
            used = _raw(used, (n - 1,), (1,), torch.int32, self.device).tolist() if used else [longest] * (n - 1)
            ends = [min(max(x, 0), total) for x in cu]
            seqs = [(s, s + max(0, min(e - s, longest, max(u, 0))), e) for s, e, u in zip(ends, ends[1:], used)]
            sides.append((seqs, ends[-1]))
        return sides

    def _sequences(self, p, lse):
        """(query rows, key rows, LSE) index/view per sequence: the whole batch when dense; each
        sequence of a variable-length batch (_rows)."""
        if not p["cu_seqlens_q"]:
            yield slice(None), slice(None), lse
            return
        (seqs_q, _), (seqs_k, _) = self._rows(p)
        for (q0, q1, _), (k0, k1, _) in zip(seqs_q, seqs_k):
            yield (slice(None), slice(q0, q1)), (slice(None), slice(k0, k1)), lse[:, :, q0:q1]

    def _padding(self, p, query_side, key_side, lse=None):
        """As the kernels' prep launch (varlen_tiles.h): the rows of a variable-length batch that
        belong to no sequence, those after the last slot and, where seqused is given, each slot's
        unused end, are 0 in the 16-bit outputs and +inf in the LSE."""
        if not p["cu_seqlens_q"]:
            return
        (seqs_q, tail_q), (seqs_k, tail_k) = self._rows(p)
        sides = ((seqs_q, tail_q, p["seqused_q"], query_side, lse), (seqs_k, tail_k, p["seqused_k"], key_side, None))
        for seqs, tail, used, outputs, side_lse in sides:
            gaps = [slice(tail, None)] + [slice(end, max(end, slot_end)) for _, end, slot_end in seqs if used]
            for rows in gaps:
                for t in outputs:
                    t[:, rows] = 0
                if side_lse is not None:
                    side_lse[:, :, rows] = float("inf")

    # -- checks ---------------------------------------------------------------------------------
    _KEYS = ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "head_dim", "softmax_scale",
             "window_left", "window_right", "softcap", "dtype", "arch")
    # The binding's variable-length keywords and their defaults (a dense batch).
    _VARLEN_KEYS = {"cu_seqlens_q": 0, "cu_seqlens_k": 0, "total_q": 0, "total_k": 0,
                    "alibi_slopes": 0, "alibi_batch_stride": 0, "dropout_p": 0.0, "rng_state": 0,
                    "seqused_q": 0, "seqused_k": 0, "head_dim_real": 0, "head_dim_v": 0, "sinks": 0}

    def _problem(self, direction, kw, check_built=True):
        kw = dict(kw)
        stream = kw.pop("stream", 0)
        assert isinstance(stream, int), f"stream must be an int, got {type(stream)}"
        passed = dict(kw)
        kw = {**self._VARLEN_KEYS, **kw}
        assert set(kw) == set(self._KEYS) | set(self._VARLEN_KEYS), f"unexpected kwargs {sorted(kw)}"
        if bool(kw["cu_seqlens_q"]) != bool(kw["cu_seqlens_k"]):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        if (kw["seqused_q"] or kw["seqused_k"]) and not kw["cu_seqlens_q"]:
            raise ValueError("seqused_q / seqused_k apply to variable-length batches only")
        if kw["cu_seqlens_q"] and direction not in VARLEN.get(kw["arch"], ()):
            raise NotImplementedError(f"fake _C: sm{kw['arch']} has no variable-length {direction} kernel")
        if (kw["softcap"] > 0 and kw["alibi_slopes"]
                and kw["head_dim"] not in SOFTCAP_ALIBI.get(kw["arch"], {}).get(direction, ())):
            raise NotImplementedError(f"fake _C: sm{kw['arch']} {direction} takes no softcap with alibi_slopes")
        if kw["head_dim"] not in INSTANTIATED:
            raise ValueError(f"head_dim {kw['head_dim']} is not instantiated")
        real = kw["head_dim_real"]
        if real and not (real % 8 == 0 and 0 < real < kw["head_dim"]):
            raise ValueError(f"head_dim_real {real} must be 0 or a multiple of 8 below head_dim {kw['head_dim']}")
        if real and direction not in NARROW_HEAD_DIM.get(kw["arch"], ()):
            raise ValueError(f"fake _C: sm{kw['arch']} {direction} takes no head_dim_real")
        own_v = HEAD_DIMS_V[kw["arch"]][direction].get(kw["head_dim"], ())
        if kw["head_dim_v"] and (real or kw["head_dim_v"] not in own_v):
            raise ValueError(f"fake _C: sm{kw['arch']} {direction} has no kernel for head_dim_v {kw['head_dim_v']} "
                             f"at head_dim {kw['head_dim']}")
        if kw["dtype"] not in DTYPES:
            raise ValueError(f"bad dtype {kw['dtype']!r}")
        if kw["nheads"] % kw["nheads_kv"]:
            raise ValueError("nheads must be a multiple of nheads_kv")
        assert isinstance(kw["softmax_scale"], float)
        assert isinstance(kw["softcap"], float) and kw["softcap"] >= 0
        assert isinstance(kw["dropout_p"], float) and 0 <= kw["dropout_p"] < 1
        if kw["dropout_p"] > 0 and (not kw["rng_state"] or kw["rng_state"] % 16):
            raise ValueError("dropout_p > 0 needs rng_state: two int64 in device memory, 16-byte aligned")
        key = (kw["arch"], direction, kw["head_dim"], kw["dtype"])
        if check_built:
            if key not in self.built:
                raise NotImplementedError(f"fake _C: kernel {key} not built")
            self.calls.append((direction, kw["arch"], passed))
        return kw

    def _tensors(self, p, dtype, **refs):
        B, Sq, Sk = p["batch"], p["seqlen_q"], p["seqlen_k"]
        if p["cu_seqlens_q"]:  # packed: (1, total, heads, d) views
            B, Sq, Sk = 1, p["total_q"], p["total_k"]
        H, Hkv, D = p["nheads"], p["nheads_kv"], p["head_dim_real"] or p["head_dim"]  # the columns in memory
        Dv = p["head_dim_v"] or D
        shapes = {
            "q": (B, Sq, H, D), "o": (B, Sq, H, Dv), "dout": (B, Sq, H, Dv), "dq": (B, Sq, H, D),
            "k": (B, Sk, Hkv, D), "v": (B, Sk, Hkv, Dv),
            "dk": (B, Sk, Hkv, D), "dv": (B, Sk, Hkv, Dv),
        }
        out = []
        for name, ref in refs.items():
            assert isinstance(ref, tuple) and len(ref) == 4, f"{name}: bad ref {ref!r}"
            ptr, *strides = ref
            assert ptr % 16 == 0, f"{name}: pointer not 16-byte aligned"
            for n, s in zip(shapes[name][:3], strides):
                assert n == 1 or (s > 0 and s % 8 == 0), f"{name}: stride {s} not a positive multiple of 8"
            out.append(_raw(ptr, shapes[name], (*strides, 1), dtype, self.device))
        return out

    def archs_called(self, direction=None):
        return [a for d, a, _ in self.calls if direction is None or d == direction]
