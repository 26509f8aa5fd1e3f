"""Test cases of the GPU accuracy suite: one Case per parametrized test, a fast and a full grid.

The grids are built at collection time from the head dims this build has (cutlass_flash
.built_kernels(); the canonical list when the binding is missing) plus head dims that are padded
(40, 72, 200), and the kernel families this GPU can run (80, plus 90 on sm90; both when there is
no GPU, where the GPU tests are skipped anyway).
"""

import dataclasses
import functools
import os
import zlib

import torch

FULL_ENV = "CUTLASS_FLASH_FULL_TESTS"


def full_grid(config):
    """Whether to run the whole GPU grid: pytest --full or CUTLASS_FLASH_FULL_TESTS=1."""
    try:
        flag = config.getoption("--full")
    except ValueError:  # the option is registered by tests/conftest.py
        flag = False
    return bool(flag) or os.environ.get(FULL_ENV, "").strip().lower() not in ("", "0", "false")


SEQLENS = (1, 17, 113, 239, 1023, 1024, 2047, 4097)
from cutlass_flash._catalog import HEAD_DIMS as INSTANTIATED_HEAD_DIMS  # noqa: E402
PADDED_HEAD_DIMS = (40, 72, 200)  # not instantiated: exercise zero-padding
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = ("contiguous", "qkvpacked", "kvpacked", "bhsd", "strided")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    dtype: str  # "fp16" | "bf16"
    causal: bool
    arch: int  # kernel family forced for the call: 80 or 90 (0 = auto)
    layout: str = "contiguous"
    q_scale: float = 1.0  # > 1: large-magnitude logits
    window: tuple = (-1, -1)  # flash_attn_func's window_size (with causal: right = 0)
    softcap: float = 0.0
    alibi: int = 0  # ALiBi slopes: 0 none, 1 (nheads,), 2 (batch, nheads)
    dropout: float = 0.0  # dropout_p

    @property
    def id(self):
        heads = {self.nheads: "mha", 1: "mqa"}.get(self.nheads_kv, "gqa")
        s = (
            f"sm{self.arch}-{self.dtype}-d{self.head_dim}-b{self.batch}"
            f"-{heads}{self.nheads}x{self.nheads_kv}-q{self.seqlen_q}-k{self.seqlen_k}"
            f"-{'causal' if self.causal else 'nomask'}-{self.layout}"
        )
        s += f"-qx{self.q_scale:g}" if self.q_scale != 1.0 else ""
        s += f"-w{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else ""
        s += f"-alibi{self.alibi}" if self.alibi else ""
        s += f"-drop{self.dropout:g}" if self.dropout else ""
        return s + (f"-cap{self.softcap:g}" if self.softcap else "")

    def alibi_slopes(self, device):
        """The case's ALiBi slopes (None without): the usual geometric series 2^(-8 (h + 1) / H),
        scaled per sequence in the (batch, nheads) form so that sequences differ."""
        if not self.alibi:
            return None
        heads = torch.arange(self.nheads, dtype=torch.float64)
        slopes = torch.pow(2.0, -8.0 * (heads + 1) / self.nheads)
        if self.alibi == 2:
            slopes = slopes.view(1, -1) * (1.0 + 0.5 * torch.arange(self.batch, dtype=torch.float64)).view(-1, 1)
        return slopes.to(device=device, dtype=torch.float32)

    @property
    def mask(self):
        """(window_left, window_right) of the call, as flash_attn_func normalizes it."""
        from cutlass_flash import _validate

        return _validate.check_mask(self.causal, self.window, self.seqlen_k)

    @property
    def seed(self):
        return zlib.crc32(self.id.encode())

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]


# ---------------------------------------------------------------------------------------------
# What this machine has.


@functools.lru_cache(maxsize=None)
def built_kernels():
    """The build's kernel list, or None without the compiled binding."""
    import cutlass_flash

    if cutlass_flash.extension_error():
        return None
    return tuple(cutlass_flash.built_kernels())


@functools.lru_cache(maxsize=None)
def kernel_archs():
    """Kernel families to test: those this GPU runs (all without a GPU)."""
    if not torch.cuda.is_available():
        return (80, 90)
    major, _ = torch.cuda.get_device_capability()
    return (80, 90) if major == 9 else (80,)


@functools.lru_cache(maxsize=None)
def head_dims():
    built = built_kernels()
    inst = INSTANTIATED_HEAD_DIMS if built is None else sorted({h for _, _, h, _ in built})
    return tuple(sorted(set(inst) | set(PADDED_HEAD_DIMS)))


def missing_kernels(case, device=None):
    """[(direction, why)] for the calls of a case this build cannot run, as cutlass_flash.plan
    answers for the case's family and shapes (the dispatch's rules are not copied here); device:
    the GPU by default (the fake binding's tests pass theirs)."""
    import cutlass_flash

    device = torch.device("cuda") if device is None else torch.device(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    q = torch.empty((1, 1, case.nheads, case.head_dim), dtype=dtype, device=device)
    k = torch.empty((1, 1, case.nheads_kv, case.head_dim), dtype=dtype, device=device)
    missing = []
    with cutlass_flash.force_arch(case.arch):
        for direction in ("fwd", "bwd"):
            try:
                cutlass_flash.plan(q, k, direction)
            except NotImplementedError as e:
                missing.append((direction, str(e)))
    return missing


# ---------------------------------------------------------------------------------------------
# Grids. Sizes keep the float64 reference cheap: batch 1 and few heads for long sequences.


def _batch_for(seqlen_q, seqlen_k):
    return 2 if max(seqlen_q, seqlen_k) <= 1024 else 1


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def head_dim_cases():
    """Every head dim (built and padded) x dtype x causal, per family."""
    return [
        Case(2, sq, sk, 4, 4, hd, dt, causal, arch)
        for arch in kernel_archs()
        for hd in head_dims()
        for dt in DTYPES
        for causal in (False, True)
        # causal with seqlen_q > seqlen_k: the first 126 query rows see no key
        for sq, sk in [((113, 239), (239, 113))[causal]]
    ]


FAST_SEQLEN_PAIRS = (
    (1, 1), (1, 239), (239, 1), (17, 113), (113, 17),
    (1023, 1024), (1024, 1023), (2047, 2047), (4097, 1023), (1023, 4097),
)


def seqlen_cases():
    """Sequence length pairs x causal, per family (head dim 128; dtype and heads rotate)."""
    out = []
    for arch in kernel_archs():
        for i, (sq, sk) in enumerate(FAST_SEQLEN_PAIRS):
            h, hkv = list(HEADS.values())[i % 3]
            dt = ("bf16", "fp16")[i % 2]
            for causal in (False, True):
                out.append(Case(_batch_for(sq, sk), sq, sk, h, hkv, 128, dt, causal, arch))
    return out


def heads_cases():
    """MHA / GQA / MQA x causal x dtype, per family."""
    return [
        Case(2, 239, 1023, 6, hkv, 64, dt, causal, arch)
        for arch in kernel_archs()
        for hkv in (6, 2, 1)
        for dt in DTYPES
        for causal in (False, True)
    ]


def layout_cases():
    """Non-contiguous inputs (packed qkv / kv, (B, H, S, D) transposed, padded rows)."""
    out = []
    for arch in kernel_archs():
        for causal in (False, True):
            out += [
                Case(2, 256, 256, 4, 2, 128, "bf16", causal, arch, "qkvpacked"),
                Case(2, 113, 300, 4, 4, 64, "fp16", causal, arch, "kvpacked"),
                Case(2, 239, 239, 4, 1, 96, "bf16", causal, arch, "bhsd"),
                Case(2, 200, 117, 4, 2, 40, "fp16", causal, arch, "strided"),
            ]
    return out


def large_logit_cases():
    """q scaled by 8: large-magnitude logits (softmax dominated by few keys)."""
    return [
        Case(2, 512, 512, 4, 4, 128, dt, causal, arch, q_scale=8.0)
        for arch in kernel_archs()
        for dt in DTYPES
        for causal in (False, True)
    ]


# Sliding windows (left, right) and the sequence pairs they run on: both sides bounded, one side,
# zero-width (each query sees one key), windows that leave the first rows of seqlen_q > seqlen_k
# without keys, and bounds past the sequence (FlashAttention-2: unbounded). With causal the right
# bound is 0 whatever window_size says.
WINDOWS = ((0, 0), (16, 0), (100, 30), (-1, 50), (50, -1), (3, 7), (5000, 5000))
WINDOW_SEQLEN_PAIRS = ((113, 239), (239, 113), (1023, 1024), (1, 17), (2047, 300))


def window_cases():
    """Sliding windows x sequence pairs, causal every third case, per family (head dims, dtypes
    and MHA/GQA/MQA rotate)."""
    dims = head_dims()
    out = []
    for arch in kernel_archs():
        i = 0
        for window in WINDOWS:
            for sq, sk in WINDOW_SEQLEN_PAIRS:
                h, hkv = list(HEADS.values())[i % 3]
                out.append(Case(_batch_for(sq, sk), sq, sk, h, hkv, dims[i % len(dims)],
                                ("bf16", "fp16")[i % 2], i % 3 == 2, arch, window=window))
                i += 1
    return out


def keyless_tile_cases():
    """Causal with seqlen_q 800 past seqlen_k: the first six 128-row query tiles see no key (O = 0,
    lse = +inf). 4 batches x 8 heads x 8 tiles are more tiles than an H100 / H200 has SMs, so a
    persistent sm90 block takes such a tile after one with keys: at d = 192 and 256 the sm90
    forward stages O in V's stages, and a tile without keys must store its zeros past them."""
    return [Case(4, 1000, 200, 8, 2, hd, "bf16", True, arch)
            for arch in kernel_archs() for hd in (192, 256) if hd in head_dims()]


def softcap_cases():
    """softcap (Gemma 2 uses 50 and 30) at every head dim, with q scaled by 4 so that tanh
    saturates for part of the scores, causal or not, a window, GQA; per family."""
    out = []
    for arch in kernel_archs():
        for i, hd in enumerate(head_dims()):
            for causal in (False, True):
                out.append(Case(2, (113, 239)[causal], 239, 4, (4, 2)[i % 2], hd, ("bf16", "fp16")[i % 2],
                                causal, arch, q_scale=4.0, softcap=(30.0, 5.0)[causal],
                                window=(-1, -1) if i % 3 else (64, 16)))
    return out


def alibi_cases():
    """ALiBi at every head dim: slopes per head or per (batch, head), causal or not, a window, GQA,
    seqlen_q != seqlen_k; per family."""
    out = []
    for arch in kernel_archs():
        for i, hd in enumerate(head_dims()):
            for causal in (False, True):
                out.append(Case(2, (113, 239)[causal], (239, 200)[causal], 4, (4, 2)[i % 2], hd,
                                ("bf16", "fp16")[i % 2], causal, arch, alibi=1 + (i + causal) % 2,
                                window=(-1, -1) if i % 3 else (64, 16)))
    return out


def dropout_cases():
    """dropout_p at every head dim, causal or not, GQA, awkward lengths (1, 17, 113, 239 and
    seqlen_q != seqlen_k), with a window, softcap or ALiBi beside it; per family."""
    out = []
    for arch in kernel_archs():
        for i, hd in enumerate(head_dims()):
            for causal in (False, True):
                # Not seqlen_k = 1: with one key the softmax's gradient is exactly 0 in PyTorch's
                # same-dtype path (the rule's bound is then the slack), while the kernels take D =
                # rowsum(dO * O) from the rounded O, which under dropout is V / (1 - p) rounded:
                # dq = 0.019 at bf16 (FlashAttention-2 computes D the same way).
                sq, sk = ((113, 239), (239, 113), (17, 33), (1, 17))[(i + 2 * causal) % 4]
                out.append(Case(2, sq, sk, 4, (4, 2)[i % 2], hd, ("bf16", "fp16")[i % 2], causal, arch,
                                dropout=(0.17, 0.5)[causal], window=(-1, -1) if i % 3 else (64, 16),
                                softcap=10.0 if i % 4 == 1 else 0.0, alibi=1 if i % 4 == 2 else 0))
        # Many key blocks, and more query tiles (4 x 4 x 9 at 128 rows) than an H100 has SMs, so
        # that the persistent sm90 dropout kernels take a second tile on some blocks; causal with
        # seqlen_q > seqlen_k: tiles whose rows see no key.
        for hd in (64, 128, 192):
            if hd in head_dims():
                for causal in (False, True):
                    out.append(Case(4, 1100, 1037, 4, 2, hd, "bf16", causal, arch, dropout=0.17))
    return out


FULL_SEQLEN_PAIRS = tuple((s, s) for s in SEQLENS) + (
    (1, 17), (17, 1), (113, 239), (239, 113), (1023, 1024), (1024, 1023),
    (2047, 4097), (4097, 2047), (1, 4097), (4097, 1), (17, 2047), (2047, 17),
)


def full_grid_cases():
    """head dim x dtype x causal x MHA/GQA/MQA x seqlen pair, per family."""
    return [
        Case(_batch_for(sq, sk), sq, sk, h, hkv, hd, dt, causal, arch)
        for arch in kernel_archs()
        for hd in head_dims()
        for dt in DTYPES
        for causal in (False, True)
        for (h, hkv) in HEADS.values()
        for sq, sk in FULL_SEQLEN_PAIRS
    ]


# ---------------------------------------------------------------------------------------------
# Inputs.


def make_inputs(case, device):
    """(q, k, v) for a case, in its layout, as views of leaf tensors that require grad."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    B, Sq, Sk, H, Hkv, D = (case.batch, case.seqlen_q, case.seqlen_k, case.nheads,
                            case.nheads_kv, case.head_dim)
    kw = dict(dtype=case.torch_dtype, device=device, generator=g)

    def randn(*shape):
        return torch.randn(*shape, **kw)

    if case.layout == "contiguous":
        leaves = [randn(B, Sq, H, D), randn(B, Sk, Hkv, D), randn(B, Sk, Hkv, D)]
    elif case.layout == "qkvpacked":  # one (B, S, H + 2 * Hkv, D) tensor
        assert Sq == Sk
        leaves = [randn(B, Sq, H + 2 * Hkv, D)]
    elif case.layout == "kvpacked":  # q and one (B, Sk, 2, Hkv, D) tensor
        leaves = [randn(B, Sq, H, D), randn(B, Sk, 2, Hkv, D)]
    elif case.layout == "bhsd":  # (B, H, S, D) tensors, transposed
        leaves = [randn(B, H, Sq, D), randn(B, Hkv, Sk, D), randn(B, Hkv, Sk, D)]
    elif case.layout == "strided":  # rows padded by 16 elements, data at offset 8
        leaves = [randn(B, Sq, H, D + 16), randn(B, Sk, Hkv, D + 16), randn(B, Sk, Hkv, D + 16)]
    else:
        raise ValueError(case.layout)

    def views():
        if case.layout == "qkvpacked":
            qkv = leaves[0]
            return qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        if case.layout == "kvpacked":
            return leaves[0], leaves[1][:, :, 0], leaves[1][:, :, 1]
        if case.layout == "bhsd":
            return tuple(t.transpose(1, 2) for t in leaves)
        if case.layout == "strided":
            return tuple(t[..., 8:8 + D] for t in leaves)
        return tuple(leaves)

    if case.q_scale != 1.0:
        views()[0].mul_(case.q_scale)
    for t in leaves:
        t.requires_grad_()
    q, k, v = views()
    if case.layout != "contiguous":
        assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    return q, k, v


def make_dout(case, device):
    g = torch.Generator(device=device).manual_seed(case.seed + 1)
    return torch.randn(case.batch, case.seqlen_q, case.nheads, case.head_dim,
                       dtype=case.torch_dtype, device=device, generator=g)
