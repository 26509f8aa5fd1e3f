"""The cost of attention sinks: flash_attn_func with sinks= against the same call without, forward
and forward + backward, each family (forced), bf16, 16k tokens x 2048 hidden, batches timed
A B B A.

    python lab/sinks_cost.py [--archs 90,80] [--out DIR]
"""
import argparse
import contextlib
import os
import statistics

import torch

import cutlass_flash
from cutlass_flash.benchmark import _batch_ms


def batch_ms(fn, n):
    return _batch_ms(fn, contextlib.nullcontext, n)


def ratio(with_fn, without_fn, rounds, budget_ms=20.0):
    """median(with) / median(without) of per-call times over batches timed A B B A, so that a
    drift of the clocks during the run falls on both alike."""
    with_fn(), without_fn()
    torch.cuda.synchronize()
    n = max(1, int(budget_ms / max(batch_ms(without_fn, 1), 1e-3)))
    a, b = [], []
    for _ in range(rounds):
        a.append(batch_ms(with_fn, n))
        b.append(batch_ms(without_fn, n))
        b.append(batch_ms(without_fn, n))
        a.append(batch_ms(with_fn, n))
    return statistics.median(a) / statistics.median(b)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--archs", default="90,80")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"# Attention sinks: time with / without ({torch.cuda.get_device_name()}, bf16, medians of "
             f"{2 * args.rounds} batches each, timed A B B A)", "",
             "| family | head_dim | seqlen | causal | fwd with / without | fwd+bwd with / without |",
             "|---:|---:|---:|---|---:|---:|"]
    for arch in (int(a) for a in args.archs.split(",")):
        for d in (int(x) for x in args.head_dims.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                for causal in (False, True):
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    dout = torch.randn_like(q)
                    sinks = torch.randn(h, device="cuda", requires_grad=True)

                    def fwd(with_sinks):
                        with torch.no_grad():
                            cutlass_flash.flash_attn_func(q, k, v, causal=causal,
                                                          sinks=sinks if with_sinks else None)

                    def both(with_sinks):
                        out = cutlass_flash.flash_attn_func(q, k, v, causal=causal,
                                                            sinks=sinks if with_sinks else None)
                        out.backward(dout)

                    with cutlass_flash.force_arch(arch):
                        r = {name: ratio(lambda: fn(True), lambda: fn(False), args.rounds)
                             for name, fn in (("fwd", fwd), ("both", both))}
                    lines.append(f"| sm{arch} | {d} | {s} | {'yes' if causal else 'no'} | "
                                 f"{r['fwd']:.3f} | {r['both']:.3f} |")
                    print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sinks-cost.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
