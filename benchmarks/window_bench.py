"""Sliding-window attention against the dense problem of the window's size, same tokens (the bar of
issue 11: a 4k window at 64k tokens in at most 1.2x the time of dense 4k sequences):

    python benchmarks/window_bench.py                          # 64k tokens, window 4096, d = 64/128/256
    python benchmarks/window_bench.py --tokens 65536 --window 4096 --head-dims 128 --out DIR

For each head dim, one sequence of `tokens` with causal=True and window_size=(window, 0) against
tokens / window sequences of `window` tokens, non-causal (the same work: every query sees
`window` keys, but for the first window's rows) and causal (half of it), forward and forward +
backward, timed side by side (cutlass_flash.benchmark.time_interleaved). FlashAttention-3 runs the same two calls where
`flash_attn_interface` imports. Prints a markdown table (and writes it under --out).
"""
import argparse
import sys

import torch

import cutlass_flash
from cutlass_flash import benchmark as bench

import bench_common


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--head-dims", type=bench._ints, default=[64, 128, 256])
    p.add_argument("--hidden", type=int, default=2048, help="nheads * head_dim")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.window < 1 or args.tokens % args.window:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --window ({args.window})")
    return args


def _calls(head_dim, args, fa3):
    """{label: (fn, context)} of the windowed and the dense problem, forward and fwd+bwd."""
    nheads = args.hidden // head_dim
    dt = torch.bfloat16
    long_qkv = [torch.randn(1, args.tokens, nheads, head_dim, device="cuda", dtype=dt,
                            requires_grad=True) for _ in range(3)]
    short_qkv = [torch.randn(args.tokens // args.window, args.window, nheads, head_dim,
                             device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
    impls = {"ours": lambda q, k, v, w, c: cutlass_flash.flash_attn_func(q, k, v, causal=c, window_size=w)}
    if fa3 is not None:
        impls["fa3"] = lambda q, k, v, w, c: fa3.flash_attn_func(q, k, v, causal=c, window_size=w)
    calls = {}
    for name, fn in impls.items():
        for shape, qkv, window, causal in (("window", long_qkv, (args.window, 0), True),
                                           ("dense", short_qkv, (-1, -1), False),
                                           ("dense-causal", short_qkv, (-1, -1), True)):
            fwd, fwdbwd = bench_common.fwd_and_fwdbwd(lambda q, k, v, fn=fn, w=window, c=causal: fn(q, k, v, w, c), qkv,
                                               torch.randn_like(qkv[0]))
            calls[(name, shape, "fwd")] = fwd
            calls[(name, shape, "fwdbwd")] = fwdbwd
    return calls


def main(argv=None):
    args = parse_args(argv)
    env = bench.environment()
    fa3 = bench._fa3_interface()
    lines = ["# Sliding window against dense sequences of the window's size", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- {args.tokens} tokens; window ({args.window}, 0) with causal against "
              f"{args.tokens // args.window} sequences of {args.window}, non-causal (the same work) and "
              f"causal (half of it); bf16; nheads * head_dim = {args.hidden}; ms, median of "
              f"{args.rounds} interleaved rounds", ""]
    lines += ["| head_dim | impl | mode | window ms | dense ms | dense causal ms | window / dense | "
              "window / dense causal |", "|---|---|---|---|---|---|---|---|"]
    for hd in args.head_dims:
        calls = _calls(hd, args, fa3)
        times = bench.time_interleaved({key: (fn, bench.contextlib.nullcontext) for key, fn in calls.items()},
                                       rounds=args.rounds, budget_ms=args.budget_ms)
        for name in sorted({k[0] for k in calls}):
            for mode in ("fwd", "fwdbwd"):
                w, d = times[(name, "window", mode)], times[(name, "dense", mode)]
                dc = times[(name, "dense-causal", mode)]
                lines.append(f"| {hd} | {name} | {mode} | {w:.3f} | {d:.3f} | {dc:.3f} | {w / d:.2f}x | "
                             f"{w / dc:.2f}x |")
    bench.write_report("\n".join(lines) + "\n", args.out, f"window-{args.tokens}-{args.window}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
