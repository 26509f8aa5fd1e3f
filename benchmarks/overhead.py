"""Per-call overhead of cutlass_flash against SDPA's FlashAttention-2 on a tiny (1, 128, 1, 64)
input, where the host's work is most of the time:

    python benchmarks/overhead.py                    # bf16, our kernel family as dispatched
    python benchmarks/overhead.py --arch 80,90 --dtype fp16

For the forward without grad, the forward with grad and forward + backward: host = wall-clock
time per call of a Python loop of --calls calls (no synchronisation), wall = including the final
synchronisation, events = CUDA-event time per call (median). Prints a markdown table and writes it
(and a CSV) under --out.
"""
import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
import warnings

import torch

try:
    from cutlass_flash import benchmark as bench
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cutlass_flash import benchmark as bench

SHAPE = (1, 128, 1, 64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    p.add_argument("--arch", type=bench._archs, default=[0],
                   help="our kernel family: auto (default), 80, 90, or 80,90 for both")
    p.add_argument("--calls", type=int, default=2000, help="calls per measurement")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--tag", default="", help="suffix for the output file names")
    return p.parse_args(argv)


def time_gpu(fn, warmup=3, repeats=30, min_repeats=5, budget_ms=100.0):
    """Median milliseconds of fn() by CUDA events around each call, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    n = max(min_repeats, min(repeats, int(budget_ms / estimate)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def run_overhead(args):
    dtype = bench.DTYPES[args.dtype]
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn(SHAPE, device="cuda", dtype=dtype)
    impls = bench.columns("ours", args.arch) + bench.columns("sdpa-flash", args.arch)
    rows = []
    print(f"per-call overhead, input {SHAPE} {args.dtype}, {args.calls} calls:")
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
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    gpu_ms = time_gpu(fn, warmup=3, repeats=200, min_repeats=50, budget_ms=5.0)
                host_us = (t1 - t0) / args.calls * 1e6
                wall_us = (t2 - t0) / args.calls * 1e6
                status = ""
            except Exception as e:
                host_us = wall_us = gpu_ms = float("nan")
                status = bench._short(e)
            rows.append(dict(impl=label, case=name, host_us=host_us, wall_us=wall_us,
                             gpu_us=gpu_ms * 1e3, status=status))
            print(f"  {label:14s} {name:14s} host {bench._fmt(host_us)} us/call, wall "
                  f"{bench._fmt(wall_us)} us/call, events {bench._fmt(gpu_ms * 1e3)} us/call"
                  + (f"  [{status}]" if status else ""), flush=True)
    return rows


def markdown(rows, env, args):
    lines = ["# cutlass_flash per-call overhead", ""] + [f"- {k}: {v}" for k, v in env.items()] + [
        "",
        f"Input {SHAPE} {args.dtype}; host = wall-clock time per call of the Python loop "
        f"({args.calls} calls, no synchronisation), wall = including the final synchronisation, "
        f"events = CUDA-event time per call (median).",
        "",
        "| impl | call | host us/call | wall us/call | events us/call |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['case']} | {bench._fmt(r['host_us'])} | "
                     f"{bench._fmt(r['wall_us'])} | {bench._fmt(r['gpu_us'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if not bench.gpu_ready(["ours"]):
        return 2
    env = bench.environment()
    rows = run_overhead(args)
    name = f"overhead-{args.dtype}" + (f"-{args.tag}" if args.tag else "")
    bench.write_report(markdown(rows, env, args), args.out, name + ".md")
    with open(os.path.join(args.out, name + ".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {os.path.join(args.out, name)}.md and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
