"""Per-kernel GPU time of one call (torch.profiler), ours against FlashAttention-3 where it imports
(or, with --peer fa2, SDPA's FlashAttention-2): where a whole-call gap comes from (main kernel,
preprocess, dQ conversion, memsets).

    python lab/kernel_times.py --mode fwdbwd --head-dims 128 --seqlens 1024,2048,8192
    python lab/kernel_times.py --mode varlen-fwd --head-dims 128
    CUTLASS_FLASH_FORCE_ARCH=80 python lab/kernel_times.py --peer fa2 --seqlens 1024

fwdbwd: dense batch x seqlen = --tokens, nheads x head_dim = --hidden, forward + backward; each
kernel's mean time over --iters calls. varlen-fwd: the forward on --tokens packed from documents
of the varlen benchmark's lengths (seeded), in the drawn order, sorted longest first and sorted
shortest first, and on equal documents of the mean length, against the dense op at that length:
if the equal documents match the dense op and the orders differ, the varlen gap is the tail.
"""
import argparse
import os
import sys

import torch

import cutlass_flash
from cutlass_flash import benchmark as bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import varlen_bench  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["fwdbwd", "varlen-fwd"], default="fwdbwd")
    p.add_argument("--head-dims", type=bench._ints, default=[128])
    p.add_argument("--seqlens", type=bench._ints, default=[1024, 2048, 8192])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--causal", type=bench._ints, default=[0, 1])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peer", choices=["fa3", "fa2"], default="fa3",
                   help="fa2: SDPA's FlashAttention-2 beside ours (fwdbwd only)")
    return p.parse_args(argv)


def _short(name):
    name = name.replace("void ", "")
    for prefix in ("cutlass_flash::", "flash::", "at::native::", "cutlass::device_kernel<"):
        name = name.replace(prefix, "")
    return name[:70]


def kernel_times(fn, iters):
    """{kernel name: mean microseconds per call} over `iters` calls of fn, and the total."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            times[_short(evt.key)] = times.get(_short(evt.key), 0.0) + t / iters
    return times


def _report(label, times):
    total = sum(times.values())
    print(f"\n### {label}: {total:.1f} us per call")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {t:9.1f} us  {name}")


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def run_fwdbwd(args, fa3):
    for hd in args.head_dims:
        nheads = args.hidden // hd
        for seqlen in args.seqlens:
            batch = max(1, args.tokens // seqlen)
            for causal in map(bool, args.causal):
                q, k, v = (torch.randn(batch, seqlen, nheads, hd, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                do = torch.randn_like(q)
                impls = {"ours": lambda: cutlass_flash.flash_attn_func(q, k, v, causal=causal)}
                if args.peer == "fa2":
                    impls["fa2"] = lambda: _sdpa_flash(q, k, v, causal)
                elif fa3 is not None:
                    impls["fa3"] = lambda: fa3.flash_attn_func(q, k, v, causal=causal)
                for name, f in impls.items():
                    def step(f=f):
                        out = f()
                        out = out[0] if isinstance(out, tuple) else out
                        torch.autograd.grad(out, (q, k, v), do)
                    _report(f"{name} d={hd} {batch}x{seqlen} causal={int(causal)}", kernel_times(step, args.iters))


def run_varlen(args, fa3):
    lengths = varlen_bench.document_lengths(args.tokens, 64, 4096, 0)
    mean = round(sum(lengths) / len(lengths) / 64) * 64
    orders = {"drawn": lengths, "longest-first": sorted(lengths, reverse=True),
              "shortest-first": sorted(lengths), "equal": [mean] * (args.tokens // mean)}
    print(f"documents (drawn order): {lengths}")
    for hd in args.head_dims:
        nheads = args.hidden // hd
        for causal in map(bool, args.causal):
            for label, ls in orders.items():
                total = sum(ls)
                cu = torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))], dtype=torch.int32, device="cuda")
                q, k, v = (torch.randn(total, nheads, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                work = sum(bench.attention_flops(1, nheads, n, n, hd, causal, "fwd") for n in ls)
                impls = {"ours": lambda: cutlass_flash.flash_attn_varlen_func(q, k, v, cu, cu, max(ls), max(ls),
                                                                              causal=causal)}
                if fa3 is not None:
                    impls["fa3"] = lambda: fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(ls), max(ls), causal=causal)
                for name, f in impls.items():
                    t = kernel_times(f, args.iters)
                    print(f"{name} d={hd} causal={int(causal)} {label:14s}: {sum(t.values()):8.1f} us, "
                          f"{work / sum(t.values()) / 1e6:6.1f} TFLOPS ({len(ls)} docs)")
            qd, kd, vd = (torch.randn(args.tokens // mean, mean, nheads, hd, device="cuda", dtype=torch.bfloat16)
                          for _ in range(3))
            work = bench.attention_flops(args.tokens // mean, nheads, mean, mean, hd, causal, "fwd")
            dense = {"ours": lambda: cutlass_flash.flash_attn_func(qd, kd, vd, causal=causal)}
            if fa3 is not None:
                dense["fa3"] = lambda: fa3.flash_attn_func(qd, kd, vd, causal=causal)
            for name, f in dense.items():
                t = kernel_times(f, args.iters)
                print(f"{name} d={hd} causal={int(causal)} {'dense':14s}: {sum(t.values()):8.1f} us, "
                      f"{work / sum(t.values()) / 1e6:6.1f} TFLOPS")


def main(argv=None):
    args = parse_args(argv)
    for k, v in bench.environment().items():
        print(f"- {k}: {v}")
    fa3 = bench._fa3_interface() if args.peer == "fa3" else None
    (run_fwdbwd if args.mode == "fwdbwd" else run_varlen)(args, fa3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
