"""Peak GPU memory of a forward + backward above its inputs (issue 31, rows 11 and 12), and the
time of the padded head dims against the next instantiated one.

    python benchmarks/hardening_memory.py --out $OUT

Rows: head dims 40 / 80 / 112 / 200 against 64 / 96 / 128 / 256 per kernel family (both read the
narrower tensors in place), and deterministic against the
default mode at 128k tokens, causal, 32 heads, head dim 128. Memory: torch.cuda.max_memory_allocated
during the call minus what was allocated before it (q, k, v, dout).
"""

import argparse
import os
import time

import torch

import cutlass_flash
from cutlass_flash import flash_attn_func


def _peak_extra(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _inputs(batch, seqlen, nheads, head_dim, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout


def _step(leaves, dout, **kw):
    def run():
        out = flash_attn_func(*leaves, **kw)
        torch.autograd.grad(out, leaves, dout)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--det-seqlen", type=int, default=131072)
    args = ap.parse_args()
    lines = [f"# Peak memory above the inputs, forward + backward ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, cutlass_flash {cutlass_flash.__version__})", ""]
    lines += ["## Head dims between instantiated ones (bf16, batch 4, 4096 tokens, 16 heads, causal)", "",
              "| family | head dim | runs at | extra MiB | / next built | ms fwd+bwd | / next built |",
              "|---|---|---|---|---|---|---|"]
    for arch in (90, 80):
        for d, nxt in ((40, 64), (80, 96), (112, 128), (200, 256)):
            res = {}
            for hd in (nxt, d):
                leaves, dout = _inputs(4, 4096, 16, hd)
                with cutlass_flash.force_arch(arch):
                    step = _step(leaves, dout, causal=True)
                    res[hd] = (_peak_extra(step), _time_ms(step))
                del leaves, dout
            (m, t), (m0, t0) = res[d], res[nxt]
            lines.append(f"| sm{arch} | {d} | {cutlass_flash.padded_head_dim(d)} | {m / 2**20:.0f} | "
                         f"{m / m0:.2f} | {t:.2f} | {t / t0:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", f"## Deterministic backward: {args.det_seqlen} tokens, causal, 32 heads, d 128, bf16", "",
              "| mode | extra GiB | / default | ms fwd+bwd |", "|---|---|---|---|"]
    leaves, dout = _inputs(1, args.det_seqlen, 32, 128)
    base = None
    for det in (False, True):
        step = _step(leaves, dout, causal=True, deterministic=det)
        m = _peak_extra(step)
        t = _time_ms(step, reps=3)
        base = base or m
        lines.append(f"| {'deterministic' if det else 'default'} | {m / 2**30:.2f} | {m / base:.2f} | {t:.1f} |")
        print(lines[-1], flush=True)
    with open(os.path.join(args.out, "hardening-memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
