"""SM clock and power under sustained load, per implementation: whether a kernel's speed against
another's comes from the work per FLOP it does or from the clock the GPU holds while it runs it
(a power-capped GPU lowers the clock of the kernel that draws more).

    python lab/power_clock.py [--seqlens 2048,4096] [--seconds 4] [--out DIR]

MLA's (192, 128) forward, bf16, 16k tokens, 16 heads, causal and not: ours and FlashAttention-3's
(flash_attn_interface on PYTHONPATH). Each runs back to back for --seconds while nvidia-smi samples
clocks.sm and power.draw every 50 ms; the table gives the medians of the samples and the TFLOPS of
the same run (FlashAttention's count)."""
import argparse
import statistics
import subprocess
import time

import torch

import cutlass_flash
from cutlass_flash.benchmark import attention_flops, write_report

try:
    import flash_attn_interface as fa3
except ImportError:
    fa3 = None


def sample(fn, seconds, flops):
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start, n = torch.cuda.Event(enable_timing=True), 0
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    lines = [ln.split(",") for ln in smi.communicate()[0].strip().splitlines()]
    # The first and last samples straddle the start and end of the load.
    rows = [tuple(float(x) for x in ln) for ln in lines[3:-2] if len(ln) == 3]
    clock = statistics.median(r[0] for r in rows)
    power = statistics.median(r[1] for r in rows)
    temp = max(r[2] for r in rows)
    return clock, power, temp, flops * n / start.elapsed_time(end) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,4096")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [f"# SM clock and power under load, {torch.cuda.get_device_name()}", "",
            "| seqlen | causal | impl | MHz | W | max C | TFLOPS |", "|---:|---|---|---:|---:|---:|---:|"]
    for seqlen in map(int, a.seqlens.split(",")):
        b, h = max(1, 16384 // seqlen), 16
        q, k = (torch.randn(b, seqlen, h, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, seqlen, h, 128, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            flops = attention_flops(b, h, seqlen, seqlen, (192 + 128) / 2, causal, "fwd")
            impls = {"own": lambda: cutlass_flash.flash_attn_func(q, k, v, causal=causal)}
            if fa3 is not None:
                impls["fa3"] = lambda: fa3.flash_attn_func(q, k, v, causal=causal)
            with torch.no_grad():
                for rnd in range(2):
                    for name, fn in impls.items():
                        fn()
                        c, p, t, tf = sample(fn, a.seconds, flops)
                        rows.append(f"| {seqlen} | {'yes' if causal else 'no'} | {name} r{rnd} | {c:.0f} | {p:.0f} | "
                                    f"{t:.0f} | {tf:.0f} |")
                        print(rows[-1], flush=True)
    write_report("\n".join(rows) + "\n", a.out, "power_clock.md")


if __name__ == "__main__":
    main()
