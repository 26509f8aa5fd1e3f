"""Packed variable-length batches against the dense op at the mean document length (the bar of
issue 11: TFLOPS on the real per-document work >= 0.9x the dense op's, and >= 1.0x
FlashAttention-3's varlen function):

    python benchmarks/varlen_bench.py                     # 16k tokens, documents of 64-4096, d = 64/128/256
    python benchmarks/varlen_bench.py --head-dims 128 --causal --out DIR

Document lengths are drawn uniformly from [--min-len, --max-len] (seeded) until --tokens are
filled (the last one cut to fit). TFLOPS count only the documents' own work, sum over documents
of FlashAttention's count (4 * H * L^2 * D, halved when causal; fwd+bwd 3.5x). The dense reference
runs tokens / mean_len sequences of the mean length. ours-sm80 is the sm80 family on the same dense
problem (variable-length batches run on it until the sm90 family takes them). FlashAttention-3
(flash_attn_interface.flash_attn_varlen_func) runs beside ours where it imports; ours-det is ours
with deterministic=True.
"""
import argparse
import random
import sys

import torch

import cutlass_flash
from cutlass_flash import benchmark as bench


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--head-dims", type=bench._ints, default=[64, 128, 256])
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def document_lengths(tokens, lo, hi, seed):
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(lo, hi), tokens - sum(lengths)))
    return lengths


def _flops(lengths, nheads, head_dim, causal, mode):
    return sum(bench.attention_flops(1, nheads, n, n, head_dim, causal, mode) for n in lengths)


def main(argv=None):
    args = parse_args(argv)
    env = bench.environment()
    fa3 = bench._fa3_interface()
    lengths = document_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    mean = round(sum(lengths) / len(lengths) / 64) * 64 or 64
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                      device="cuda")
    lines = ["# Packed variable-length batch against the dense op at the mean length", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {len(lengths)} documents, {sum(lengths)} tokens, lengths {args.min_len}-{args.max_len} "
              f"(seed {args.seed}), mean {sum(lengths) / len(lengths):.0f}; dense: "
              f"{args.tokens // mean} x {mean}; causal={args.causal}; bf16; nheads * head_dim = "
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
                        q, k, v, cu, cu, longest, longest, causal=args.causal),
                     lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=args.causal)),
            "ours-det": (lambda q, k, v: cutlass_flash.flash_attn_varlen_func(
                            q, k, v, cu, cu, longest, longest, causal=args.causal, deterministic=True),
                         lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=args.causal,
                                                                       deterministic=True)),
        }
        if (80, "fwd", hd, "bf16") in cutlass_flash.built_kernels():  # a build restricted to sm90 has none
            impls["ours-sm80"] = (None, lambda q, k, v: _forced(80, q, k, v, args.causal))
        if fa3 is not None:
            impls["fa3"] = (lambda q, k, v: fa3.flash_attn_varlen_func(
                                q, k, v, cu, cu, longest, longest, causal=args.causal),
                            lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=args.causal))
        calls = {}
        for name, (varlen_fn, dense_fn) in impls.items():
            for shape, fn, qkv in (("varlen", varlen_fn, packed), ("dense", dense_fn, dense)):
                if fn is None:
                    continue
                fwd, fwdbwd = bench.fwd_and_fwdbwd(fn, qkv, torch.randn_like(qkv[0]))
                calls[(name, shape, "fwd")] = (fwd, bench.contextlib.nullcontext)
                calls[(name, shape, "fwdbwd")] = (fwdbwd, bench.contextlib.nullcontext)
        times = bench.time_interleaved(calls, rounds=args.rounds, budget_ms=args.budget_ms)
        for mode in ("fwd", "fwdbwd"):
            work_varlen = _flops(lengths, nheads, hd, args.causal, mode)
            work_dense = bench.attention_flops(args.tokens // mean, nheads, mean, mean, hd, args.causal, mode)
            for name in impls:
                dense_tf = work_dense / times[(name, "dense", mode)] / 1e9
                if (name, "varlen", mode) in times:
                    var_tf = work_varlen / times[(name, "varlen", mode)] / 1e9
                    lines.append(f"| {hd} | {mode} | {name} | {var_tf:.1f} | {dense_tf:.1f} | {var_tf / dense_tf:.2f}x |")
                else:
                    lines.append(f"| {hd} | {mode} | {name} | - | {dense_tf:.1f} | - |")
    bench.write_report("\n".join(lines) + "\n", args.out, f"varlen-{args.tokens}{'-causal' if args.causal else ''}.md")
    return 0


def _forced(arch, q, k, v, causal):
    with cutlass_flash.force_arch(arch):
        return cutlass_flash.flash_attn_func(q, k, v, causal=causal)


if __name__ == "__main__":
    sys.exit(main())
