"""Packed variable-length batches against the dense op at the mean document length (the bar of
issue 11: TFLOPS on the real per-document work >= 0.9x the dense op's, and >= 1.0x
FlashAttention-3's varlen function), and long-tailed mixes of document lengths (--mix):

    python benchmarks/varlen_bench.py                     # 16k tokens, documents of 64-4096, d = 64/128/256
    python benchmarks/varlen_bench.py --head-dims 128 --causal --out DIR
    python benchmarks/varlen_bench.py --mix all           # every mix, d = 64/128/256, causal and not
    python benchmarks/varlen_bench.py --mix long32k-short64,loguniform --head-dims 128 --causal true

Without --mix: document lengths are drawn uniformly from [--min-len, --max-len] (seeded) until
--tokens are filled (the last one cut to fit). TFLOPS count only the documents' own work, sum over
documents of FlashAttention's count (4 * H * L^2 * D, halved when causal; fwd+bwd 3.5x). The dense
reference runs tokens / mean_len sequences of the mean length. ours-sm80 is the sm80 family on the
same dense problem (variable-length batches run on it until the sm90 family takes them).
FlashAttention-3 (flash_attn_interface.flash_attn_varlen_func) runs beside ours where it imports;
ours-det is ours with deterministic=True.

With --mix: each named mix of document lengths (MIXES; `all`: every one) is packed into one batch,
bf16, --nheads query heads (16) and --nheads-kv key/value heads (default: as many, MHA), at each
of --head-dims and --causal (both by default), and the forward and forward + backward are timed for
ours (cutlass_flash.flash_attn_varlen_func) and FlashAttention-3's varlen function where
`import flash_attn_interface` works and its build has varlen and the head dim (skipped with a note
otherwise: `FLASH_ATTENTION_DISABLE_VARLEN=FALSE bash lab/device_fa3.sh` builds it with
varlen); for long32k-short64 also ours dense on the 32k document alone (packed / alone: how much
the 2000 short documents add to its time). TFLOPS as above, summed over the documents; ours / FA3
is the ratio of TFLOPS (> 1: ours faster). Timing: CUDA events around batches of back-to-back
calls, every implementation and mode of a configuration interleaved over --rounds rounds, median
(cutlass_flash.benchmark.time_interleaved). Writes CSV and markdown to --out (benchmarks/results).
"""
import argparse
import csv
import math
import os
import random
import sys

import torch

import cutlass_flash
from cutlass_flash import benchmark as bench

import bench_common

# Named mixes of document lengths (--mix), packed in this order: the long documents first.
MIXES = {
    "long32k-short64": "1 x 32768 + 2000 x 64 tokens",
    "long16k-512": "1 x 16384 + 64 x 512 tokens",
    "two8k-short128": "2 x 8192 + 500 x 128 tokens",
    "mild": "lengths uniform in [--min-len, --max-len] (64-4096) until --tokens (16384), seeded",
    "loguniform": "lengths log-uniform in [32, 32768] until --loguniform-tokens (65536), seeded",
}
# Mixes whose longest document also runs alone through the dense op (ours), for packed / alone.
ALONE = ("long32k-short64",)
LOGUNIFORM_RANGE = (32, 32768)


def _mixes(text):
    names = [x.strip() for x in text.split(",") if x.strip()]
    if "all" in names:
        return list(MIXES)
    for x in names:
        if x not in MIXES:
            raise argparse.ArgumentTypeError(f"--mix: expected all or some of {', '.join(MIXES)}; got {x!r}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="mixes:\n" + "\n".join(f"  {k:16s} {v}" for k, v in MIXES.items()))
    p.add_argument("--mix", type=_mixes, default=None,
                   help="comma-separated mixes of document lengths, or all (see below); without it, "
                        "the packed batch against the dense op at the mean length")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the drawn batch (and of mix mild)")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--loguniform-tokens", type=int, default=65536, help="token budget of mix loguniform")
    p.add_argument("--head-dims", type=bench._ints, default=[64, 128, 256])
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim, without --mix")
    p.add_argument("--nheads", type=int, default=16, help="query heads, with --mix (16)")
    p.add_argument("--nheads-kv", type=int, default=None, help="key/value heads, with --mix (default: --nheads)")
    p.add_argument("--causal", nargs="?", type=bench._causal, const=[True], default=None,
                   help="both, true or false (--causal alone: true); default: false without --mix, both with it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--out", default=None,
                   help="output directory (default: none without --mix, benchmarks/results with it)")
    p.add_argument("--tag", default="", help="suffix of the output file names (with --mix)")
    args = p.parse_args(argv)
    if args.nheads_kv is None:
        args.nheads_kv = args.nheads
    if args.nheads % args.nheads_kv:
        p.error(f"--nheads {args.nheads} must be a multiple of --nheads-kv {args.nheads_kv}")
    return args


def document_lengths(tokens, lo, hi, seed):
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(lo, hi), tokens - sum(lengths)))
    return lengths


def loguniform_lengths(tokens, lo, hi, seed):
    """Lengths drawn log-uniformly from [lo, hi] (seeded) until tokens are filled, the last one cut
    to fit."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        n = min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        lengths.append(min(n, tokens - sum(lengths)))
    return lengths


def mix_lengths(name, args):
    """The document lengths of a named mix, in packing order."""
    if name == "long32k-short64":
        return [32768] + [64] * 2000
    if name == "long16k-512":
        return [16384] + [512] * 64
    if name == "two8k-short128":
        return [8192] * 2 + [128] * 500
    if name == "mild":
        return document_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    if name == "loguniform":
        return loguniform_lengths(args.loguniform_tokens, *LOGUNIFORM_RANGE, args.seed)
    raise ValueError(name)


def _flops(lengths, nheads, head_dim, causal, mode):
    return sum(bench.attention_flops(1, nheads, n, n, head_dim, causal, mode) for n in lengths)


def _cu_seqlens(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


# ---------------------------------------------------------------------------------------------
# Without --mix: the packed batch against the dense op at the mean length.


def run_dense_comparison(args, causal):
    env = bench.environment()
    fa3 = bench._fa3_interface()
    lengths = document_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    mean = round(sum(lengths) / len(lengths) / 64) * 64 or 64
    cu = _cu_seqlens(lengths)
    lines = ["# Packed variable-length batch against the dense op at the mean length", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {len(lengths)} documents, {sum(lengths)} tokens, lengths {args.min_len}-{args.max_len} "
              f"(seed {args.seed}), mean {sum(lengths) / len(lengths):.0f}; dense: "
              f"{args.tokens // mean} x {mean}; causal={causal}; bf16; nheads * head_dim = "
              f"{args.hidden}; TFLOPS on each problem's own work, median of {args.rounds} interleaved rounds", ""]
    lines += ["| head_dim | mode | impl | varlen TFLOPS | dense TFLOPS | varlen / dense |",
              "|---|---|---|---|---|---|"]
    for hd in args.head_dims:
        nheads = args.hidden // hd
        dt = torch.bfloat16
        packed = [torch.randn(sum(lengths), nheads, hd, device="cuda", dtype=dt, requires_grad=True)
                  for _ in range(3)]
        dense = [torch.randn(args.tokens // mean, mean, nheads, hd, device="cuda", dtype=dt,
                             requires_grad=True) for _ in range(3)]
        longest = max(lengths)
        impls = {
            "ours": (lambda q, k, v: cutlass_flash.flash_attn_varlen_func(
                        q, k, v, cu, cu, longest, longest, causal=causal),
                     lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=causal)),
            "ours-det": (lambda q, k, v: cutlass_flash.flash_attn_varlen_func(
                            q, k, v, cu, cu, longest, longest, causal=causal, deterministic=True),
                         lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=causal,
                                                                       deterministic=True)),
        }
        if (80, "fwd", hd, "bf16") in cutlass_flash.built_kernels():  # a build restricted to sm90 has none
            impls["ours-sm80"] = (None, lambda q, k, v: _forced(80, q, k, v, causal))
        if fa3 is not None:
            impls["fa3"] = (lambda q, k, v: fa3.flash_attn_varlen_func(
                                q, k, v, cu, cu, longest, longest, causal=causal),
                            lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal))
        calls = {}
        for name, (varlen_fn, dense_fn) in impls.items():
            for shape, fn, qkv in (("varlen", varlen_fn, packed), ("dense", dense_fn, dense)):
                if fn is None:
                    continue
                fwd, fwdbwd = bench_common.fwd_and_fwdbwd(fn, qkv, torch.randn_like(qkv[0]))
                calls[(name, shape, "fwd")] = (fwd, bench.contextlib.nullcontext)
                calls[(name, shape, "fwdbwd")] = (fwdbwd, bench.contextlib.nullcontext)
        times = bench.time_interleaved(calls, rounds=args.rounds, budget_ms=args.budget_ms)
        for mode in ("fwd", "fwdbwd"):
            work_varlen = _flops(lengths, nheads, hd, causal, mode)
            work_dense = bench.attention_flops(args.tokens // mean, nheads, mean, mean, hd, causal, mode)
            for name in impls:
                dense_tf = work_dense / times[(name, "dense", mode)] / 1e9
                if (name, "varlen", mode) in times:
                    var_tf = work_varlen / times[(name, "varlen", mode)] / 1e9
                    lines.append(f"| {hd} | {mode} | {name} | {var_tf:.1f} | {dense_tf:.1f} "
                                 f"| {var_tf / dense_tf:.2f}x |")
                else:
                    lines.append(f"| {hd} | {mode} | {name} | - | {dense_tf:.1f} | - |")
    bench.write_report("\n".join(lines) + "\n", args.out, f"varlen-{args.tokens}{'-causal' if causal else ''}.md")


def _forced(arch, q, k, v, causal):
    with cutlass_flash.force_arch(arch):
        return cutlass_flash.flash_attn_func(q, k, v, causal=causal)


# ---------------------------------------------------------------------------------------------
# --mix: long-tailed mixes of document lengths, ours beside FlashAttention-3's varlen function.

MODES = ("fwd", "fwdbwd")
CSV_FIELDS = ["mix", "documents", "tokens", "longest", "head_dim", "nheads", "nheads_kv", "causal", "mode",
              "impl", "ms", "tflops", "status"]


def _fa3_varlen_note(fa3, head_dim):
    """Why FA3's varlen function cannot run at head_dim (None: it can)."""
    if fa3 is None:
        return "flash_attn_interface does not import"
    if bench._fa3_build_flags().get("FLASHATTENTION_DISABLE_VARLEN"):
        return ("FA3 built without varlen (FLASH_ATTENTION_DISABLE_VARLEN=FALSE bash "
                "lab/device_fa3.sh builds it)")
    dtypes, head_dims = bench._fa3_built()
    if "bf16" not in dtypes or head_dim not in head_dims:
        return f"FA3 build has no bf16 kernel at head_dim {head_dim} (built: {','.join(map(str, head_dims))})"
    return None


def _try_once(fn):
    """None if fn() runs, else the error in a line (the call is then left out of the timing)."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a kernel the build lacks, a refusal of FA3
        return bench._short(e)


def run_mix(args, mix, fa3, rows):
    """Times every head dim and causal setting of one mix; appends CSV rows."""
    lengths = mix_lengths(mix, args)
    print(f"\n{mix}: {len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)} "
          f"({MIXES[mix]})", flush=True)
    cu = _cu_seqlens(lengths)
    for hd in args.head_dims:
        _run_head_dim(args, mix, lengths, cu, hd, fa3, rows)  # its tensors are freed on return


def _run_head_dim(args, mix, lengths, cu, hd, fa3, rows):
    total, longest = sum(lengths), max(lengths)
    H, Hkv, dt = args.nheads, args.nheads_kv, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(args.seed)

    def randn(*shape, grad=True):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=g).requires_grad_(grad)

    packed = [randn(total, H, hd), randn(total, Hkv, hd), randn(total, Hkv, hd)]
    packed_dout = randn(total, H, hd, grad=False)
    alone = alone_dout = None
    if mix in ALONE:  # the longest document alone, dense (1, longest, heads, hd)
        alone = [randn(1, longest, H, hd), randn(1, longest, Hkv, hd), randn(1, longest, Hkv, hd)]
        alone_dout = randn(1, longest, H, hd, grad=False)
    fa3_note = _fa3_varlen_note(fa3, hd)
    if fa3_note:
        print(f"note: no FA3 column at d={hd}: {fa3_note}", flush=True)
    for causal in args.causal:
        impls = {"ours": (lambda q, k, v, c=causal: cutlass_flash.flash_attn_varlen_func(
                              q, k, v, cu, cu, longest, longest, causal=c), packed, packed_dout)}
        if fa3_note is None:
            # FA3 returns out or (out, softmax_lse) by version: fwd_and_fwdbwd takes either.
            impls["fa3"] = (lambda q, k, v, c=causal: fa3.flash_attn_varlen_func(
                                q, k, v, cu, cu, longest, longest, causal=c), packed, packed_dout)
        if alone is not None:
            impls["ours-alone"] = (lambda q, k, v, c=causal: cutlass_flash.flash_attn_func(q, k, v, causal=c),
                                   alone, alone_dout)
        calls, status = {}, {}
        for name, (fn, qkv, dout) in impls.items():
            fwd, fwdbwd = bench_common.fwd_and_fwdbwd(fn, qkv, dout)
            for mode, call in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                status[(name, mode)] = _try_once(call)
                if status[(name, mode)] is None:
                    calls[(name, mode)] = (call, bench.contextlib.nullcontext)
                else:
                    print(f"note: {name} {mode} d={hd} causal={int(causal)}: {status[(name, mode)]}", flush=True)
        times = bench.time_interleaved(calls, rounds=args.rounds, budget_ms=args.budget_ms) if calls else {}
        for name in impls:
            docs = [longest] if name == "ours-alone" else lengths
            for mode in MODES:
                ms = times.get((name, mode))
                work = _flops(docs, H, hd, causal, mode)
                rows.append(dict(mix=mix, documents=len(docs), tokens=sum(docs), longest=longest, head_dim=hd,
                                 nheads=H, nheads_kv=Hkv, causal=int(causal), mode=mode, impl=name, ms=ms,
                                 tflops=None if ms is None else work / ms / 1e9, status=status[(name, mode)] or ""))
        line = ", ".join(f"{name} {mode} {times[(name, mode)]:.3f} ms" for name in impls for mode in MODES
                         if (name, mode) in times)
        print(f"{mix} d={hd} causal={int(causal)}: {line}", flush=True)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def mix_table(rows):
    """The compact markdown table: a row per mix, head dim, causal and mode."""
    index = {(r["mix"], r["head_dim"], r["causal"], r["mode"], r["impl"]): r for r in rows}
    keys = []
    for r in rows:
        key = (r["mix"], r["head_dim"], r["causal"], r["mode"])
        if key not in keys:
            keys.append(key)
    lines = ["| mix | d | causal | mode | ours ms | ours TFLOPS | FA3 ms | FA3 TFLOPS | ours / FA3 | "
             "32k alone ms | packed / alone |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mix, hd, causal, mode in keys:
        get = (lambda impl, field: (index.get((mix, hd, causal, mode, impl)) or {}).get(field))
        ours_ms, fa3_ms, alone_ms = get("ours", "ms"), get("fa3", "ms"), get("ours-alone", "ms")
        ratio = fa3_ms / ours_ms if ours_ms and fa3_ms else None
        packed_alone = ours_ms / alone_ms if ours_ms and alone_ms else None
        lines.append(f"| {mix} | {hd} | {'yes' if causal else 'no'} | {mode} | {_fmt(ours_ms, '.3f')} | "
                     f"{_fmt(get('ours', 'tflops'), '.1f')} | {_fmt(fa3_ms, '.3f')} | "
                     f"{_fmt(get('fa3', 'tflops'), '.1f')} | {_fmt(ratio, '.2f')}{'x' if ratio else ''} | "
                     f"{_fmt(alone_ms, '.3f')} | {_fmt(packed_alone, '.3f')}{'x' if packed_alone else ''} |")
    return "\n".join(lines) + "\n"


def run_mixes(args):
    env = bench.environment()
    env["FA3"] = bench_common.fa3_info()
    for key, val in env.items():  # GPU and versions first
        print(f"{key:22s} {val}", flush=True)
    fa3 = bench._fa3_interface()
    rows = []
    for mix in args.mix:
        run_mix(args, mix, fa3, rows)
    out_dir = args.out or os.path.join("benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "varlen-mix-" + ("all" if args.mix == list(MIXES) else "+".join(args.mix))
                        + (f"-{args.tag}" if args.tag else ""))
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else ("" if r[k] is None else r[k]))
                        for k in CSV_FIELDS})
    table = mix_table(rows)
    lines = ["# Long-tailed mixes of document lengths: packed batches, ours beside FlashAttention-3's varlen", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    for mix in args.mix:
        lengths = mix_lengths(mix, args)
        lines.append(f"- {mix}: {len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)}, "
                     f"shortest {min(lengths)} ({MIXES[mix]})")
    lines += [f"- bf16, {args.nheads} query heads, {args.nheads_kv} key/value heads; TFLOPS by FlashAttention's "
              "count summed over the documents (forward 4 * H * sum(L^2) * D, halved when causal; fwd+bwd "
              "3.5x); ours / FA3: ratio of TFLOPS (> 1: ours faster); 32k alone: ours dense on the 32768-token "
              "document alone (long32k-short64), packed / alone: ratio of times; median of "
              f"{args.rounds} rounds, every implementation and mode of a configuration interleaved, CUDA events "
              f"around batches of back-to-back calls (about {args.budget_ms:g} ms each)", ""]
    for r in rows:
        if r["status"]:
            lines.append(f"- n/a: {r['mix']} d={r['head_dim']} causal={r['causal']} {r['impl']} {r['mode']}: "
                         f"{r['status']}")
    md = "\n".join(lines) + "\n\n" + table
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(f"\nwrote {stem}.csv and {stem}.md\n")
    print(table)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("varlen_bench needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.mix:
        if args.causal is None:
            args.causal = [False, True]
        run_mixes(args)
    else:
        for causal in args.causal or [False]:
            run_dense_comparison(args, causal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
