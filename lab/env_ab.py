"""One library, several settings of a lab-only environment knob, timed side by side in one process
(time_interleaved): each column is our call with the environment set as named, read by the
library's host code at every call. FlashAttention-3 beside them where it imports
(flash_attn_interface on PYTHONPATH) and has the head dims; bf16, 16k tokens a batch, 16 heads.

    python lab/env_ab.py --env base: --env grid:CF_LAB_BWD_GROUP=0 --dims 192:128,192,256 \
        [--seqlens 2048,8192] [--modes bwd] [--causal 0,1] [--out DIR]

An env column is LABEL:VAR=VALUE[,VAR=VALUE] (LABEL: alone runs with none of the named variables
set). Ratios are of each column's TFLOPS to the first's.
"""
import argparse
import os

import torch

import cutlass_flash
from cutlass_flash.benchmark import attention_flops, time_interleaved, write_report

try:
    import flash_attn_interface as fa3
except ImportError:
    fa3 = None


def _parse_env(spec):
    label, _, assigns = spec.partition(":")
    return label, dict(a.split("=", 1) for a in assigns.split(",") if a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", required=True)
    ap.add_argument("--dims", default="192:128")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--modes", default="bwd")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--fa3-dims", default="192:128,192", help="head dims FlashAttention-3 was built with")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    envs = dict(_parse_env(s) for s in a.env)
    names = list(envs)
    knobs = sorted({k for e in envs.values() for k in e})
    rows = [f"# env A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
            f"TFLOPS (FlashAttention's count, d = (d_qk + d_v) / 2); ratios to `{names[0]}`; columns: "
            + "; ".join(f"{n} = {envs[n] or 'unset'}" for n in names), "",
            "| mode | d | seqlen | causal | " + " | ".join(names + ["fa3"]) + " | "
            + " | ".join(f"{n} / {names[0]}" for n in names[1:] + ["fa3"]) + " |",
            "|---|---|---:|---|" + "---:|" * (2 * len(names) + 1)]
    for dims in a.dims.split(","):
        d, _, dv = dims.partition(":")
        d, dv = int(d), int(dv or d)
        for seqlen in map(int, a.seqlens.split(",")):
            batch, h = max(1, 16384 // seqlen), a.nheads
            g = torch.Generator(device="cuda").manual_seed(seqlen + d)
            q, k = (torch.randn(batch, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            v, dout = (torch.randn(batch, seqlen, h, dv, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(2))
            for causal in map(bool, map(int, a.causal.split(","))):
                calls = {}

                def with_env(env, f):
                    def run():
                        for kname in knobs:
                            if kname in env:
                                os.environ[kname] = env[kname]
                            else:
                                os.environ.pop(kname, None)
                        return f()
                    return run

                impls = {n: (lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=causal)) for n in names}
                if fa3 is not None and dims in a.fa3_dims.split(","):
                    impls["fa3"] = lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal)
                for mode in a.modes.split(","):
                    for n, f in impls.items():
                        env = envs.get(n, {})
                        if mode == "fwd":
                            calls[n] = (with_env(env, lambda f=f: f(q, k, v)), torch.no_grad)
                        else:
                            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                            with torch.enable_grad():
                                out = with_env(env, lambda f=f: f(qq, kk, vv))()
                            calls[n] = (with_env(env, lambda out=out, qq=qq, kk=kk, vv=vv: torch.autograd.grad(
                                out, (qq, kk, vv), dout, retain_graph=True)), torch.enable_grad)
                    ms = time_interleaved(calls, rounds=7)
                    flops = attention_flops(batch, h, seqlen, seqlen, (d + dv) / 2, causal, mode)
                    t = {n: flops / m / 1e9 for n, m in ms.items()}
                    cells = " | ".join(f"{t[n]:.0f}" if n in t else "-" for n in names + ["fa3"])
                    ratios = " | ".join(f"{t[n] / t[names[0]]:.3f}" if n in t else "-" for n in names[1:] + ["fa3"])
                    rows.append(f"| {mode} | {dims} | {seqlen} | {'yes' if causal else 'no'} | {cells} | {ratios} |")
                    print(rows[-1], flush=True)
    write_report("\n".join(rows) + "\n", a.out, "env_ab.md")


if __name__ == "__main__":
    main()
