"""Benchmark cutlass_flash on this GPU against FlashAttention-3 (where `import flash_attn_interface`
works) and PyTorch SDPA's FlashAttention-2, cuDNN and memory-efficient backends.

    python -m cutlass_flash.benchmark                      # FlashAttention-3 paper grid, bf16
    python -m cutlass_flash.benchmark --arch 80,90         # both kernel families, side by side
    python -m cutlass_flash.benchmark --dtype bf16,fp16    # both dtypes in one run
    python -m cutlass_flash.benchmark --head-dims 128 --seqlens 4096 --causal true --modes fwd

Grid (FlashAttention-3 paper): head dims 64/128/256, seqlens 512..16384, batch * seqlen = 16384
tokens, nheads * head_dim = 2048, causal and not. Times forward, backward and forward+backward
with CUDA events: after warm-up, --rounds rounds each time a batch of back-to-back calls of every
implementation in turn, and the median over the rounds is reported; TFLOPS by FlashAttention's
count: forward 4 * batch * nheads * seqlen_q * seqlen_k * head_dim (halved when causal), backward
2.5x that, forward+backward 3.5x. Writes CSV, markdown and (with matplotlib) a PNG to --out.
The repository's benchmarks/features.py adds variant columns and an output check to this grid,
and benchmarks/overhead.py times the per-call overhead.
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
IMPLS = ("ours", *SDPA_IMPLS, "fa3")
# Reference implementations in the order of the "ours / ..." ratio columns, and their short names.
RATIO_REFS = ("sdpa-flash", "sdpa-cudnn", "fa3")
REF_LABEL = {"sdpa-flash": "FA2", "sdpa-cudnn": "cuDNN", "sdpa-efficient": "efficient", "fa3": "FA3"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ints(text):
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _listed(option, words):
    """The parser of a comma-separated option whose words are the keys of words (values: what each
    word stands for, a list for several) or the items of a tuple (each for itself)."""
    words = words if isinstance(words, dict) else {w: w for w in words}

    def parse(text):
        out = []
        for x in (x for x in text.lower().replace(" ", "").split(",") if x):
            if x not in words:
                raise argparse.ArgumentTypeError(f"{option}: expected some of {', '.join(words)}; got {x!r}")
            out += words[x] if isinstance(words[x], list) else [words[x]]
        return out
    return parse


_causal = _listed("--causal", {"both": [False, True], **dict.fromkeys(("true", "1", "yes", "causal"), True),
                                **dict.fromkeys(("false", "0", "no", "nomask"), False)})
_archs = _listed("--arch", {"auto": 0, "0": 0, "80": 80, "sm80": 80, "90": 90, "sm90": 90})


def build_parser(prog="python -m cutlass_flash.benchmark", description=__doc__, impls=IMPLS):
    """The grid's options; --impls accepts the names in impls (default: IMPLS, all of them)."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=_ints, default=[64, 128, 256], help="default 64,128,256")
    p.add_argument("--seqlens", type=_ints, default=[512, 1024, 2048, 4096, 8192, 16384], help="default 512,...,16384")
    p.add_argument("--causal", type=_causal, default=[False, True], help="both (default), true or false")
    p.add_argument("--modes", type=_listed("--modes", MODES), default=list(MODES), help="some of fwd,bwd,fwdbwd")
    p.add_argument("--dtype", type=_listed("--dtype", tuple(DTYPES)), default=["bf16"],
                   help="bf16 (default), fp16, or bf16,fp16 for both in one run")
    p.add_argument("--arch", type=_archs, default=[0],
                   help="our kernel family: auto (default), 80, 90, or 80,90 for both columns")
    p.add_argument("--impls", type=_listed("--impls", impls), default=list(IMPLS),
                   help=f"default: {','.join(IMPLS)} (fa3: FlashAttention-3, skipped with a note where "
                        "flash_attn_interface does not import)")
    p.add_argument("--total-tokens", type=int, default=16384, help="batch * seqlen (16384)")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim (2048)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per config (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--budget-ms", type=float, default=200.0,
                   help="about this much timed GPU time per implementation and config, split over the rounds")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="default benchmarks/results")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def _driver_version():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0]
    except Exception:
        v = torch._C._cuda_getDriverVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"


def environment():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        groups = {}
        for a, d, h, t in cutlass_flash.built_kernels():
            groups.setdefault((a, d, t), []).append(h)
        built_txt = "; ".join(f"sm{a} {d} {t}: {','.join(map(str, sorted(hs)))}"
                              for (a, d, t), hs in sorted(groups.items())) or "none"
    except ImportError as e:
        built_txt = f"unavailable ({str(e).splitlines()[0][:120]})"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"gpu": f"{props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                   f"{props.total_memory / 2**30:.0f} GiB)",
            "driver": _driver_version(), "cuda": str(torch.version.cuda), "cudnn": str(cudnn),
            "torch": torch.__version__, "cutlass_flash": cutlass_flash.__version__,
            "cutlass_flash kernels": built_txt, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _batch_ms(fn, context, n):
    """Milliseconds per call of n back-to-back calls of fn between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start.record()
        for _ in range(n):
            fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def time_interleaved(fns, warmup=3, rounds=5, budget_ms=200.0, max_batch=1000):
    """Milliseconds per call of each of {label: (fn, context)}, measured side by side.

    After `warmup` calls each, one untimed round and then `rounds` rounds each time a batch of
    back-to-back calls (about budget_ms / rounds of GPU time) of every implementation in turn,
    between two CUDA events; the median over the rounds is reported. Interleaving puts every
    implementation at the same point of the GPU's clock and power history (which drifts by up to
    10% under sustained load: PERFLOG.md, entries 17 and 70); a batch between two events keeps the
    host's launch latency out where the host is the slower side (short problems).
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


def attention_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode):
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * FLOPS_FACTOR[mode]


def write_report(text, out_dir, filename):
    """Prints a markdown report and writes it under out_dir (when given)."""
    print(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(text)


def _short(e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {msg[:160]}"


# Implementations: factory(causal) -> a forward function of (q, k, v) in (B, S, H, D) layout.


def _ours(causal, **kwargs):
    return lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=causal, **kwargs)


def _sdpa(name, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

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
        print(f"note: no FA3 column: import flash_attn_interface failed ({_short(e)})", flush=True)
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


def _fa3_built():
    """(dtypes, head dims) FA3's build has kernels for."""
    flags = _fa3_build_flags()
    dtypes = ("bf16",) + (() if flags.get("FLASHATTENTION_DISABLE_FP16") else ("fp16",))
    return dtypes, tuple(d for d in (64, 96, 128, 192, 256) if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}"))


def fa3_info():
    """One line for the environment: FA3's version and what its build has kernels for."""
    if _fa3_interface() is None:
        return "not available"
    try:
        import flash_attn_3

        version = getattr(flash_attn_3, "__version__", "unknown")
    except Exception:
        version = "unknown"
    dtypes, head_dims = _fa3_built()
    return f"flash_attn_3 {version}; built {','.join(dtypes)}, head dims {','.join(map(str, head_dims))}"


def _fa3(causal, **kwargs):
    fa3 = _fa3_interface()
    dtypes, head_dims = _fa3_built()
    built = {DTYPES[d] for d in dtypes}

    def fwd(q, k, v):
        # Only what the build has: FA3 would round another head dim up to a built one (padded).
        if q.dtype not in built or q.shape[-1] not in head_dims:
            raise ValueError(f"FA3 build has no kernel for {q.dtype} head_dim {q.shape[-1]} "
                             f"(built: {','.join(dtypes)}; {','.join(map(str, head_dims))})")
        out = fa3.flash_attn_func(q, k, v, causal=causal, **kwargs)
        # Older FA3 returns (out, softmax_lse); newer returns out unless return_attn_probs.
        return out[0] if isinstance(out, (tuple, list)) else out
    return fwd


def columns(impl, archs):
    """[(label, factory, context)] of one --impls name: ours gives one column per kernel family in
    archs, whose context forces that family while it is measured (auto: none, so
    CUTLASS_FLASH_FORCE_ARCH holds); fa3 none, with a note, where flash_attn_interface does not import."""
    if impl == "ours":
        return [("ours" if a == 0 else f"ours-sm{a}", _ours,
                 contextlib.nullcontext if a == 0 else (lambda a=a: cutlass_flash.force_arch(a))) for a in archs]
    if impl == "fa3":
        return [("fa3", _fa3, contextlib.nullcontext)] if _fa3_interface() is not None else []
    return [(impl, lambda causal: _sdpa(impl, causal), contextlib.nullcontext)]


def implementations(args):
    """(label, factory(causal) -> forward fn, context) in column order."""
    return [c for impl in args.impls for c in columns(impl, args.arch)]


def grid(args):
    """[(dtype, head_dim, seqlen, causal)] of the run, in order."""
    return [(dt, hd, s, c) for dt in args.dtype for hd in args.head_dims for s in args.seqlens for c in args.causal]


def inputs(args, dt, hd, seqlen):
    """(batch, nheads, q, k, v, dout) of a config: seeded, q, k and v requiring grad."""
    nheads, batch = max(1, args.hidden // hd), max(1, args.total_tokens // seqlen)
    g = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + hd)
    shape = (batch, seqlen, nheads, hd)
    q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPES[dt], generator=g).requires_grad_() for _ in range(3))
    return batch, nheads, q, k, v, torch.randn(shape, device="cuda", dtype=DTYPES[dt], generator=g)


def _mode_fn(mode, fwd, q, k, v, dout):
    if mode == "fwd":
        return lambda: fwd(q, k, v)
    if mode == "bwd":
        out = fwd(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), dout)


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


def run_grid(args, impls):
    labels = [label for label, _, _ in impls]
    rows = []
    configs = grid(args)
    t_start = time.perf_counter()
    for i, (dt, hd, seqlen, causal) in enumerate(configs, 1):
        batch, nheads, q, k, v, dout = inputs(args, dt, hd, seqlen)
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
                rows.append(dict(dtype=dt, head_dim=hd, seqlen=seqlen, batch=batch, nheads=nheads,
                                 causal=int(causal), mode=mode, impl=label, ms=ms, tflops=tflops,
                                 status=failed.get(label, "")))
                cells.append(f"{label} {_fmt(tflops)}")
            print(f"    {mode:7s} TFLOPS: " + " | ".join(cells), flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    print(f"grid done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return rows, labels


def _fmt(x, digits=1):
    return "n/a" if x != x else f"{x:.{digits}f}"


def write_csv(path, rows):
    fields = list(rows[0]) if rows else []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in fields})


def markdown(rows, labels, env, args):
    lines = ["# cutlass_flash benchmark", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- dtype {', '.join(args.dtype)}; batch * seqlen = {args.total_tokens} tokens, "
              f"nheads * head_dim = {args.hidden}; TFLOPS (FlashAttention's count); median of "
              f"{args.rounds} rounds, each timing a batch of back-to-back calls of every "
              f"implementation in turn (CUDA events, about {args.budget_ms:g} ms per implementation "
              f"and config)", ""]
    ratio_cols = [(o, r) for o in labels if o.startswith("ours") for r in RATIO_REFS if r in labels]
    index = {(r["dtype"], r["mode"], r["head_dim"], r["seqlen"], r["causal"], r["impl"]): r for r in rows}
    for dt, mode in [(dt, mode) for dt in args.dtype for mode in args.modes]:
        header = ["head_dim", "seqlen", "batch x nheads", "causal"] + labels + [
            f"{o} / {REF_LABEL[r]}" for o, r in ratio_cols]
        lines += [f"## {dt} {mode}", "", "| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
        for hd, seqlen, causal in [(hd, s, c) for hd in args.head_dims for s in args.seqlens for c in args.causal]:
            key = (dt, mode, hd, seqlen, int(causal))
            cells = [index.get(key + (lb,)) for lb in labels]
            if all(c is None for c in cells):
                continue
            first = next(c for c in cells if c is not None)
            row = [str(hd), str(seqlen), f"{first['batch']} x {first['nheads']}", "yes" if causal else "no"]
            row += [_fmt(c["tflops"]) if c else "n/a" for c in cells]
            for o, r in ratio_cols:
                a, b = index.get(key + (o,)), index.get(key + (r,))
                ok = a and b and a["tflops"] == a["tflops"] and b["tflops"] == b["tflops"]
                row.append(f"{a['tflops'] / b['tflops']:.2f}x" if ok else "n/a")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    failures = sorted({(r["impl"], r["status"]) for r in rows if r["status"]})
    if failures:
        lines += ["## n/a reasons", ""] + [f"- {impl}: {status}" for impl, status in failures] + [""]
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
            for (c, label), causal in [(lb, cs) for lb in enumerate(labels) for cs in args.causal]:
                key = (dt, mode, hd, label, causal)
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows if r["tflops"] == r["tflops"]
                             and (r["dtype"], r["mode"], r["head_dim"], r["impl"], r["causal"]) == key)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                            color=colors[c % len(colors)], linestyle="--" if causal else "-",
                            label=f"{label}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set(title=f"{mode}, head_dim {hd}, {dt}", xlabel="seqlen", ylabel="TFLOPS")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def gpu_ready(impls):
    """False, with the reason, without a CUDA GPU; a warning where our extension does not load."""
    if not torch.cuda.is_available():
        print("cutlass_flash.benchmark needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return False
    err = cutlass_flash.extension_error()
    if err and any(i.startswith("ours") for i in impls):
        print(f"warning: {err}\nour columns will read n/a", file=sys.stderr)
    return True


def run(args, impls, env):
    """Prints env, times the grid of impls, writes CSV, markdown and the plot to --out."""
    for key, val in env.items():
        print(f"{key:22s} {val}")
    print(flush=True)
    name = f"bench-{'-'.join(args.dtype)}" + (f"-{args.tag}" if args.tag else "")
    stem = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    rows, labels = run_grid(args, impls)
    write_csv(stem + ".csv", rows)
    print(f"wrote {stem}.csv")
    if not args.no_plot and plot(stem + ".png", rows, labels, args):
        print(f"wrote {stem}.png")
    write_report(markdown(rows, labels, env, args), args.out, name + ".md")
    print(f"wrote {stem}.md")


def main(argv=None):
    args = parse_args(argv)
    if not gpu_ready(args.impls):
        return 2
    env = environment()
    if "fa3" in args.impls:
        env["FA3"] = fa3_info()
    run(args, implementations(args), env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
