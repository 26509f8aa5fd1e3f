"""MLA's (192, 128) forward (issue 33): the sm90 kernel with V's head dim as its own against the
same call on the d = 192 kernel with V zero-padded (what the forward ran before, and what the
backward runs), and SDPA's backends where they take a V of its own head dim; bf16, 16k tokens per
batch, 16 heads, causal and not. Checks each output against the padded run first.

    python lab/mla_fwd.py [--seqlens 2048,8192] [--out DIR]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cutlass_flash
from cutlass_flash.benchmark import time_interleaved, write_report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [f"# MLA (192, 128) forward, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
            "| seqlen | causal | own kernel TFLOPS | padded TFLOPS | own / padded | cuDNN | own / cuDNN | max diff |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for seqlen in map(int, a.seqlens.split(",")):
        batch, h = max(1, 16384 // seqlen), a.nheads
        g = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k = (torch.randn(batch, seqlen, h, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        v = torch.randn(batch, seqlen, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for causal in (False, True):
            assert cutlass_flash.plan(q, k, v=v).head_dim_v == 128, "no kernel of its own for (192, 128)"

            def own():
                return cutlass_flash.flash_attn_func(q, k, v, causal=causal)

            def padded():
                return cutlass_flash.flash_attn_func(q, k, F.pad(v, (0, 64)), causal=causal)[..., :128]

            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

            fns = {"own": (own, torch.no_grad), "padded": (padded, torch.no_grad)}
            diff = (own().float() - padded().float()).abs().max().item()
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn()
                fns["cudnn"] = (cudnn, lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
            except RuntimeError as e:
                print(f"cuDNN: {str(e)[:120]}")
            ms = time_interleaved(fns, rounds=7)
            flops = 2 * batch * h * seqlen * seqlen * (192 + 128) / (2 if causal else 1)
            t = {n: flops / m / 1e9 for n, m in ms.items()}
            cd = t.get("cudnn", float("nan"))
            rows.append(f"| {seqlen} | {'yes' if causal else 'no'} | {t['own']:.0f} | {t['padded']:.0f} | "
                        f"{t['own'] / t['padded']:.3f} | {cd:.0f} | {t['own'] / cd:.3f} | {diff:.2e} |")
            print(rows[-1], flush=True)
    write_report("\n".join(rows) + "\n", a.out, "mla-fwd.md")


if __name__ == "__main__":
    main()
