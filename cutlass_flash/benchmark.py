"""Benchmark cutlass_flash against PyTorch SDPA's backends (FlashAttention-2, cuDNN, efficient)
and, where `import flash_attn_interface` works (lab/device_fa3.sh builds it), FlashAttention-3.

    python -m cutlass_flash.benchmark                      # FlashAttention-3 paper grid, bf16
    python -m cutlass_flash.benchmark --arch 80,90         # both kernel families, side by side
    python -m cutlass_flash.benchmark --dtype bf16,fp16    # both dtypes in one run
    python -m cutlass_flash.benchmark --head-dims 128 --seqlens 4096 --causal true --modes fwd
    python -m cutlass_flash.benchmark --overhead-only      # per-call host overhead, tiny input

Grid (FlashAttention-3 paper): head dims 64/128/256, seqlens 512..16384, batch * seqlen = 16384
tokens, nheads * head_dim = 2048, causal and not. Times forward, backward and forward+backward
with CUDA events: after warm-up, --rounds rounds each time a batch of back-to-back calls of every
implementation in turn, and the median over the rounds is reported; TFLOPS by FlashAttention's
count: forward 4 * batch * nheads * seqlen_q * seqlen_k * head_dim (halved when causal), backward
2.5x that, forward+backward 3.5x. Writes CSV, markdown and (with matplotlib) a PNG to --out.
"""

import argparse
import contextlib
import csv
import datetime
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import cutlass_flash

MODES = ("fwd", "bwd", "fwdbwd")
FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
SDPA_IMPLS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
SDPA_LABEL = {"sdpa-flash": "FA2", "sdpa-cudnn": "cuDNN", "sdpa-efficient": "efficient"}
# Reference implementations in the order of the "ours / ..." ratio columns, and their short names.
RATIO_REFS = ("sdpa-flash", "sdpa-cudnn", "fa3")
REF_LABEL = {**SDPA_LABEL, "fa3": "FA3"}
# Every --impls value; ours-det is ours with deterministic=True, ours-softcap with softcap=SOFTCAP,
# ours-alibi with ALiBi slopes, ours-dropout with dropout_p=DROPOUT; fa3-det is FlashAttention-3 with
# deterministic=True (the reference for the cost of ours-det), fa3-softcap FA3 with softcap=SOFTCAP
# (the reference for the cost of ours-softcap).
IMPLS = ("ours", "ours-det", "ours-softcap", "ours-alibi", "ours-dropout", *SDPA_IMPLS, "fa3", "fa3-det",
         "fa3-softcap")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Arguments


def _ints(text):
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _causal(text):
    text = text.strip().lower()
    if text in ("both", "all"):
        return [False, True]
    out = []
    for x in text.split(","):
        if x in ("1", "true", "yes", "causal"):
            out.append(True)
        elif x in ("0", "false", "no", "nomask"):
            out.append(False)
        else:
            raise argparse.ArgumentTypeError(f"--causal: expected both, true or false, got {x!r}")
    return out


def _modes(text):
    out = [m.strip() for m in text.split(",") if m.strip()]
    for m in out:
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"--modes: expected some of {MODES}, got {m!r}")
    return out


def _archs(text):
    out = []
    for x in text.split(","):
        x = x.strip().lower()
        if x in ("auto", "0"):
            out.append(0)
        elif x.removeprefix("sm") in ("80", "90"):
            out.append(int(x.removeprefix("sm")))
        else:
            raise argparse.ArgumentTypeError(f"--arch: expected auto, 80, 90 or 80,90, got {x!r}")
    return out


def _dtypes(text):
    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in DTYPES:
            raise argparse.ArgumentTypeError(f"--dtype: expected bf16, fp16 or bf16,fp16, got {x!r}")
    return out


def _impls(text):
    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in IMPLS:
            raise argparse.ArgumentTypeError(
                f"--impls: expected some of {', '.join(IMPLS)}; got {x!r}"
            )
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m cutlass_flash.benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--head-dims", type=_ints, default=[64, 128, 256], help="default 64,128,256")
    p.add_argument("--seqlens", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="default 512,1024,...,16384")
    p.add_argument("--causal", type=_causal, default=[False, True],
                   help="both (default), true or false")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="some of fwd,bwd,fwdbwd")
    p.add_argument("--dtype", type=_dtypes, default=["bf16"],
                   help="bf16 (default), fp16, or bf16,fp16 for both in one run")
    p.add_argument("--arch", type=_archs, default=[0],
                   help="our kernel family: auto (default), 80, 90, or 80,90 for both columns")
    p.add_argument("--impls", type=_impls, default=["ours", *SDPA_IMPLS, "fa3"],
                   help="default: ours,sdpa-flash,sdpa-cudnn,sdpa-efficient,fa3 (fa3: "
                        "FlashAttention-3, skipped with a note where flash_attn_interface does "
                        "not import); ours-det: ours with deterministic=True; ours-softcap: "
                        f"ours with softcap={SOFTCAP:g}; ours-alibi: ours with ALiBi slopes; "
                        f"ours-dropout: ours with dropout_p={DROPOUT:g}; fa3-det: FA3 with "
                        f"deterministic=True; fa3-softcap: FA3 with softcap={SOFTCAP:g} (n/a "
                        "where FA3 was built without softcap)")
    p.add_argument("--total-tokens", type=int, default=16384, help="batch * seqlen (16384)")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim (2048)")
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds per config; each times a batch of calls of every "
                        "implementation in turn (median over rounds reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--budget-ms", type=float, default=200.0,
                   help="about this much timed GPU time per implementation and config, split "
                        "over the rounds")
    p.add_argument("--check", action="store_true",
                   help="also compare our output with SDPA's for each config (max abs diff)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"),
                   help="output directory (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--overhead", action="store_true",
                   help="also measure per-call overhead on a (1, 128, 1, 64) input")
    p.add_argument("--overhead-only", action="store_true", help="only the overhead measurement")
    p.add_argument("--calls", type=int, default=2000, help="calls per overhead measurement")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Environment


def _driver_version():
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except Exception:
        pass
    try:
        v = torch._C._cuda_getDriverVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:
        return "unknown"


def environment():
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    try:
        built = cutlass_flash.built_kernels()
        groups = {}
        for a, d, h, t in built:
            groups.setdefault((a, d, t), []).append(h)
        built_txt = "; ".join(
            f"sm{a} {d} {t}: {','.join(map(str, sorted(hs)))}"
            for (a, d, t), hs in sorted(groups.items())
        ) or "none"
    except ImportError as e:
        built_txt = f"unavailable ({str(e).splitlines()[0][:120]})"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "gpu": f"{props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs, "
               f"{props.total_memory / 2**30:.0f} GiB)",
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "cudnn": str(cudnn),
        "torch": torch.__version__,
        "cutlass_flash": cutlass_flash.__version__,
        "cutlass_flash kernels": built_txt,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Timing


def _sync():
    torch.cuda.synchronize()


def time_gpu(fn, warmup=3, repeats=30, min_repeats=5, budget_ms=100.0):
    """Median milliseconds of fn() by CUDA events around each call, after warm-up."""
    for _ in range(warmup):
        fn()
    _sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    _sync()
    estimate = max(start.elapsed_time(end), 1e-3)
    n = max(min_repeats, min(repeats, int(budget_ms / estimate)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    _sync()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _batch_ms(fn, context, n):
    """Milliseconds per call of n back-to-back calls of fn between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start.record()
        for _ in range(n):
            fn()
        end.record()
    _sync()
    return start.elapsed_time(end) / n


def time_interleaved(fns, warmup=3, rounds=5, budget_ms=200.0, max_batch=1000):
    """Milliseconds per call of each of {label: (fn, context)}, measured side by side.

    After `warmup` calls each, `rounds` rounds time a batch of back-to-back calls of every
    implementation in turn (about budget_ms / rounds of GPU time per batch); the median over the
    rounds is reported. Interleaving puts every implementation at the same point of the GPU's
    clock and power history: under sustained attention load the lent H200 sits at its 700 W cap
    and its clock wanders between 1.4 and 1.95 GHz, so the implementation timed first after an
    idle gap read up to 10% faster than the same code timed later (PERFLOG.md, entry 17).
    A batch is timed between two events rather than each call, because per-call events add the
    host's launch latency to every call whenever the host is the slower side (short problems).
    One untimed round runs first: on a lent H100 the first two rounds after the warmup calls ran
    up to 10% faster than the later ones (the clock settles under sustained load), which with 3
    rounds moved medians by the implementation's place in the order (PERFLOG.md, entry 70).
    """
    batch = {}
    for label, (fn, context) in fns.items():
        for _ in range(warmup):
            _batch_ms(fn, context, 1)
        batch[label] = max(1, min(max_batch, int(budget_ms / rounds / max(_batch_ms(fn, context, 1), 1e-3))))
    times = {label: [] for label in fns}
    for r in range(rounds + 1):
        for label, (fn, context) in fns.items():
            t = _batch_ms(fn, context, batch[label])
            if r > 0:
                times[label].append(t)
    return {label: statistics.median(t) for label, t in times.items()}


def fwd_and_fwdbwd(fn, qkv, dout):
    """The two timed calls of the benchmark scripts (benchmarks/*_bench.py) for fn(*qkv): the
    forward without grad, and forward + backward for dout (fn may return (out, ...))."""
    def fwd():
        with torch.no_grad():
            return fn(*qkv)

    def fwdbwd():
        out = fn(*qkv)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, qkv, dout)

    return fwd, fwdbwd


def write_report(text, out_dir, filename):
    """Prints a script's markdown table and writes it under out_dir (when given)."""
    print(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(text)


def attention_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode):
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * FLOPS_FACTOR[mode]


# ---------------------------------------------------------------------------------------------
# Implementations: each returns a forward function of (q, k, v) in (B, S, H, D) layout.


# ours-softcap's cap: Gemma 2's attn_logit_softcapping.
SOFTCAP = 50.0
# ours-dropout's probability: FlashAttention's and BERT/GPT-2's attention dropout.
DROPOUT = 0.1


def _ours(causal, deterministic=False, softcap=0.0, alibi=False, dropout_p=0.0):
    def fwd(q, k, v):
        slopes = None
        if alibi:  # ALiBi's usual slopes, 2^(-8 (h + 1) / H)
            heads = torch.arange(q.shape[2], device=q.device, dtype=torch.float32)
            slopes = torch.pow(2.0, -8.0 * (heads + 1) / q.shape[2])
        return cutlass_flash.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, softcap=softcap,
                                             alibi_slopes=slopes, deterministic=deterministic)
    return fwd


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]


def _sdpa(name, causal):
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backend(name)

    def fwd(q, k, v):
        # SDPA takes (B, H, S, D): transposed views, no copies.
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
        return out.transpose(1, 2)
    return fwd


@functools.lru_cache(maxsize=None)
def _fa3_interface():
    """FlashAttention-3's flash_attn_interface module, or None (with a note, printed once)."""
    try:
        import flash_attn_interface
    except Exception as e:  # not built, or its extension does not load
        print(f"note: no FA3 column: import flash_attn_interface failed ({_short(e)}); "
              "lab/device_fa3.sh builds it", flush=True)
        return None
    return flash_attn_interface


def _fa3_build_flags():
    """The FLASHATTENTION_DISABLE_* flags of FA3's build, from the flash_attn_config.CONFIG its
    setup.py writes beside flash_attn_interface (none where that is missing: everything built)."""
    try:
        from flash_attn_config import CONFIG

        return CONFIG["build_flags"]
    except Exception:
        return {}


def _fa3_has_softcap():
    return not _fa3_build_flags().get("FLASHATTENTION_DISABLE_SOFTCAP")


def _fa3_built():
    """(dtypes, head dims) FA3's build has kernels for."""
    flags = _fa3_build_flags()
    dtypes = ("bf16",) + (() if flags.get("FLASHATTENTION_DISABLE_FP16") else ("fp16",))
    head_dims = tuple(d for d in (64, 96, 128, 192, 256)
                      if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}"))
    return dtypes, head_dims


def fa3_info():
    """One line for the environment: FA3's version, source commits and what was built."""
    fa3 = _fa3_interface()
    if fa3 is None:
        return "not available"
    try:
        import flash_attn_3

        version = getattr(flash_attn_3, "__version__", "unknown")
    except Exception:
        version = "unknown"
    text = f"flash_attn_3 {version}"
    # SOURCE.txt (lab/pack_fa3src.sh) sits at the top of the tree that holds hopper/.
    source = os.path.join(os.path.dirname(os.path.abspath(fa3.__file__)), os.pardir, "SOURCE.txt")
    try:
        with open(source) as f:
            commits = [line.split() for line in f if line.strip()]
        text += "".join(f", {c[0]} {c[1][:12]}" for c in commits if len(c) >= 2)
    except OSError:
        pass
    dtypes, head_dims = _fa3_built()
    return text + f"; built {','.join(dtypes)}, head dims {','.join(map(str, head_dims))}"


# FlashAttention-3's deterministic backward exists up to this head dim: it rounds a head dim up
# to 64 / 96 / 128 / 192 / 256 and refuses the rounded 256 (flash_api.cpp).
FA3_DETERMINISTIC_MAX_HEAD_DIM = 192


def _fa3(causal, deterministic=False, softcap=0.0):
    fa3 = _fa3_interface()
    dtypes, head_dims = _fa3_built()
    built = {DTYPES[d] for d in dtypes}
    kwargs = {**({"deterministic": True} if deterministic else {}), **({"softcap": softcap} if softcap else {})}
    missing_softcap = softcap and not _fa3_has_softcap()  # read once, not in the timed calls

    def fwd(q, k, v):
        # Only what the build has: FA3 would round another head dim up to a built one (padded).
        if q.dtype not in built or q.shape[-1] not in head_dims:
            raise ValueError(f"FA3 build has no kernel for {q.dtype} head_dim {q.shape[-1]} "
                             f"(built: {','.join(dtypes)}; {','.join(map(str, head_dims))})")
        # FA3 refuses it (flash_api.cpp: "Deterministic backward not supported for hdim 256"),
        # and in one H100 run (2026-11-25) its refusal took the benchmark process down with it.
        if deterministic and q.shape[-1] > FA3_DETERMINISTIC_MAX_HEAD_DIM:
            raise ValueError(f"FA3 has no deterministic backward at head_dim {q.shape[-1]}")
        if missing_softcap:
            raise ValueError("FA3 build has no softcap (FLASH_ATTENTION_DISABLE_SOFTCAP)")
        out = fa3.flash_attn_func(q, k, v, causal=causal, **kwargs)
        # Older FA3 returns (out, softmax_lse); newer returns out unless return_attn_probs.
        return out[0] if isinstance(out, (tuple, list)) else out
    return fwd


def implementations(args):
    """(label, factory(causal) -> forward fn, context) in column order. The context forces our
    kernel family while that column is measured (auto: none, so CUTLASS_FLASH_FORCE_ARCH holds).
    fa3 is left out, with a note, where flash_attn_interface does not import."""
    out = []
    for impl in args.impls:
        if impl == "ours":
            for arch in args.arch:
                label = "ours" if arch == 0 else f"ours-sm{arch}"
                ctx = contextlib.nullcontext if arch == 0 else (
                    lambda a=arch: cutlass_flash.force_arch(a))
                out.append((label, _ours, ctx))
        elif impl == "ours-det":  # deterministic=True, kernel family automatic
            out.append((impl, lambda causal: _ours(causal, deterministic=True), contextlib.nullcontext))
        elif impl == "ours-softcap":  # softcap=SOFTCAP, kernel family automatic
            out.append((impl, lambda causal: _ours(causal, softcap=SOFTCAP), contextlib.nullcontext))
        elif impl == "ours-alibi":  # ALiBi slopes per head, kernel family automatic
            out.append((impl, lambda causal: _ours(causal, alibi=True), contextlib.nullcontext))
        elif impl == "ours-dropout":  # dropout_p=DROPOUT, kernel family automatic
            out.append((impl, lambda causal: _ours(causal, dropout_p=DROPOUT), contextlib.nullcontext))
        elif impl in ("fa3", "fa3-det", "fa3-softcap"):
            if _fa3_interface() is not None:
                out.append((impl, lambda causal, det=impl == "fa3-det", cap=SOFTCAP if impl == "fa3-softcap" else 0.0:
                            _fa3(causal, det, cap), contextlib.nullcontext))
        else:
            out.append((impl, lambda causal, n=impl: _sdpa(n, causal), contextlib.nullcontext))
    return out


def _mode_fn(mode, fwd, q, k, v, dout):
    if mode == "fwd":
        return lambda: fwd(q, k, v)
    if mode == "bwd":
        out = fwd(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), dout)


def _short(e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:160]}"


# ---------------------------------------------------------------------------------------------
# The grid


def _prepare(impls, causal, mode, q, k, v, dout):
    """{label: (fn, context)} of the implementations that run this config, and {label: status}
    of those that do not."""
    ready, failed = {}, {}
    for label, factory, context in impls:
        fwd = factory(causal)
        try:
            with context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = _mode_fn(mode, fwd, q, k, v, dout)
                fn()  # can it run this config at all?
            ready[label] = (fn, context)
        except Exception as e:
            failed[label] = _short(e)
            torch.cuda.empty_cache()
    return ready, failed


def run_grid(args):
    impls = implementations(args)
    labels = [label for label, _, _ in impls]
    rows = []
    configs = [(dt, hd, seqlen, causal) for dt in args.dtype for hd in args.head_dims
               for seqlen in args.seqlens for causal in args.causal]
    t_start = time.perf_counter()
    for i, (dt, hd, seqlen, causal) in enumerate(configs, 1):
        nheads = max(1, args.hidden // hd)
        batch = max(1, args.total_tokens // seqlen)
        g = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + hd)
        shape = (batch, seqlen, nheads, hd)
        q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPES[dt], generator=g)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn(shape, device="cuda", dtype=DTYPES[dt], generator=g)
        print(f"[{i}/{len(configs)}] {dt} head_dim={hd} seqlen={seqlen} batch={batch} "
              f"nheads={nheads} causal={int(causal)}", flush=True)
        for mode in args.modes:
            ready, failed = _prepare(impls, causal, mode, q, k, v, dout)
            times = time_interleaved(ready, args.warmup, args.rounds, args.budget_ms)
            del ready
            flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal, mode)
            cells = []
            for label in labels:
                ms = times.get(label, float("nan"))
                tflops = flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
                rows.append(dict(dtype=dt, head_dim=hd, seqlen=seqlen, batch=batch,
                                 nheads=nheads, causal=int(causal), mode=mode, impl=label,
                                 ms=ms, tflops=tflops, status=failed.get(label, "")))
                cells.append(f"{label} {_fmt(tflops)}")
            print(f"    {mode:7s} TFLOPS: " + " | ".join(cells), flush=True)
        if args.check:
            _print_check(impls, causal, q, k, v)
        del q, k, v, dout
        torch.cuda.empty_cache()
    print(f"grid done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return rows, labels


def _print_check(impls, causal, q, k, v):
    outputs = {}
    for label, factory, context in impls:
        try:
            with context(), warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                outputs[label] = factory(causal)(q, k, v).float()
        except Exception:
            pass
    if len(outputs) > 1:
        base_label, base = next(iter(outputs.items()))
        print("    max|out - " + base_label + "|: " + ", ".join(
            f"{lb} {(o - base).abs().max().item():.3g}"
            for lb, o in outputs.items() if lb != base_label), flush=True)


def _fmt(x, digits=1):
    return "n/a" if x != x else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------------------
# Reports


def write_csv(path, rows):
    fields = ["dtype", "head_dim", "seqlen", "batch", "nheads", "causal", "mode", "impl", "ms",
              "tflops", "status"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in fields})


def markdown(rows, labels, env, args):
    lines = ["# cutlass_flash benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        f"- dtype {', '.join(args.dtype)}; batch * seqlen = {args.total_tokens} tokens, "
        f"nheads * head_dim = {args.hidden}; TFLOPS (FlashAttention's count); median of "
        f"{args.rounds} rounds, each timing a batch of back-to-back calls of every "
        f"implementation in turn (CUDA events, about {args.budget_ms:g} ms per implementation "
        f"and config)",
        "",
    ]
    ours = [lb for lb in labels if lb.startswith("ours")]
    refs = [r for r in RATIO_REFS if r in labels]
    ratio_cols = [(o, r) for o in ours for r in refs]
    index = {(r["dtype"], r["mode"], r["head_dim"], r["seqlen"], r["causal"], r["impl"]): r
             for r in rows}
    for dt, mode in [(dt, mode) for dt in args.dtype for mode in args.modes]:
        lines += [f"## {dt} {mode}", ""]
        header = ["head_dim", "seqlen", "batch x nheads", "causal"] + labels + [
            f"{o} / {REF_LABEL[r]}" for o, r in ratio_cols
        ]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---:" for _ in header) + "|")
        for hd in args.head_dims:
            for seqlen in args.seqlens:
                for causal in args.causal:
                    key = (dt, mode, hd, seqlen, int(causal))
                    cells = [index.get(key + (lb,)) for lb in labels]
                    if all(c is None for c in cells):
                        continue
                    first = next(c for c in cells if c is not None)
                    row = [str(hd), str(seqlen), f"{first['batch']} x {first['nheads']}",
                           "yes" if causal else "no"]
                    row += [_fmt(c["tflops"]) if c else "n/a" for c in cells]
                    for o, r in ratio_cols:
                        a, b = index.get(key + (o,)), index.get(key + (r,))
                        ok = a and b and a["tflops"] == a["tflops"] and b["tflops"] == b["tflops"]
                        row.append(f"{a['tflops'] / b['tflops']:.2f}x" if ok else "n/a")
                    lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    failures = sorted({(r["impl"], r["status"]) for r in rows if r["status"]})
    if failures:
        lines += ["## n/a reasons", ""]
        lines += [f"- {impl}: {status}" for impl, status in failures]
        lines.append("")
    return "\n".join(lines)


def plot(path, rows, labels, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    panels = [(dt, mode) for dt in args.dtype for mode in args.modes]
    nr, nc = len(panels), len(args.head_dims)
    fig, axes = plt.subplots(nr, nc, figsize=(4.5 * nc, 3.6 * nr), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (dt, mode) in enumerate(panels):
        for j, hd in enumerate(args.head_dims):
            ax = axes[i][j]
            for c, label in enumerate(labels):
                for causal in args.causal:
                    pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                                 if r["dtype"] == dt and r["mode"] == mode and r["head_dim"] == hd
                                 and r["impl"] == label and r["causal"] == int(causal)
                                 and r["tflops"] == r["tflops"])
                    if not pts:
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                            color=colors[c % len(colors)], linestyle="--" if causal else "-",
                            label=f"{label}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, head_dim {hd}, {dt}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOPS")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Per-call overhead


def run_overhead(args):
    """Host time per call on a tiny (1, 128, 1, 64) input, ours vs SDPA FLASH_ATTENTION."""
    dtype = DTYPES[args.dtype[0]]
    shape = (1, 128, 1, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn(shape, device="cuda", dtype=dtype)
    impls = [i for i in implementations(args) if i[0].startswith("ours")]
    impls.append(("sdpa-flash", lambda causal: _sdpa("sdpa-flash", causal), contextlib.nullcontext))
    rows = []
    print(f"per-call overhead, input {shape} {args.dtype[0]}, {args.calls} calls:")
    for label, factory, context in impls:
        fwd = factory(False)
        cases = {
            "fwd (no grad)": lambda: fwd(q, k, v),
            "fwd (grad)": lambda: fwd(qg, kg, vg),
            "fwd+bwd": lambda: torch.autograd.grad(fwd(qg, kg, vg), (qg, kg, vg), dout),
        }
        for name, fn in cases.items():
            try:
                grad = torch.no_grad() if name == "fwd (no grad)" else contextlib.nullcontext()
                with context(), grad, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for _ in range(50):
                        fn()
                    _sync()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    t1 = time.perf_counter()
                    _sync()
                    t2 = time.perf_counter()
                    gpu_ms = time_gpu(fn, warmup=3, repeats=200, min_repeats=50, budget_ms=5.0)
                host_us = (t1 - t0) / args.calls * 1e6
                wall_us = (t2 - t0) / args.calls * 1e6
                status = ""
            except Exception as e:
                host_us = wall_us = gpu_ms = float("nan")
                status = _short(e)
            rows.append(dict(impl=label, case=name, host_us=host_us, wall_us=wall_us,
                             gpu_us=gpu_ms * 1e3, status=status))
            print(f"  {label:14s} {name:14s} host {_fmt(host_us)} us/call, wall "
                  f"{_fmt(wall_us)} us/call, events {_fmt(gpu_ms * 1e3)} us/call"
                  + (f"  [{status}]" if status else ""), flush=True)
    return rows


def overhead_markdown(rows, args):
    lines = [
        "## Per-call overhead",
        "",
        f"Input (1, 128, 1, 64) {args.dtype[0]}; host = wall-clock time per call of the Python loop "
        f"({args.calls} calls, no synchronisation), wall = including the final synchronisation, "
        f"events = CUDA-event time per call (median).",
        "",
        "| impl | call | host us/call | wall us/call | events us/call |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['case']} | {_fmt(r['host_us'])} | "
                     f"{_fmt(r['wall_us'])} | {_fmt(r['gpu_us'])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cutlass_flash.benchmark needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    err = cutlass_flash.extension_error()
    if err and "ours" in args.impls:
        print(f"warning: {err}\nour columns will read n/a", file=sys.stderr)
    env = environment()
    if any(i.startswith("fa3") for i in args.impls) and not args.overhead_only:
        env["FA3"] = fa3_info()
    for key, val in env.items():
        print(f"{key:22s} {val}")
    print(flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench-{'-'.join(args.dtype)}" + (f"-{args.tag}" if args.tag else ""))
    md = ""
    if not args.overhead_only:
        rows, labels = run_grid(args)
        write_csv(stem + ".csv", rows)
        md = markdown(rows, labels, env, args)
        print(f"wrote {stem}.csv")
        if not args.no_plot and plot(stem + ".png", rows, labels, args):
            print(f"wrote {stem}.png")
    if args.overhead or args.overhead_only:
        ov = run_overhead(args)
        if not md:
            md = "# cutlass_flash benchmark\n\n" + "\n".join(f"- {k}: {v}" for k, v in env.items())
            md += "\n\n"
        md += overhead_markdown(ov, args)
        with open(stem + "-overhead.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ov[0]))
            w.writeheader()
            w.writerows(ov)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(f"wrote {stem}.md")
    if not args.overhead_only:
        print()
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
