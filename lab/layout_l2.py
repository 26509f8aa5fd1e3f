"""Whether the memory order of the blocks running at one time is where the sm80 forward loses to
FlashAttention-2 (issue 32): ours (forced sm80) and SDPA's FlashAttention-2, non-causal forward,
with q, k, v stored (batch, seqlen, heads, d) as usual or (batch, heads, seqlen, d) (the same
logical tensors, permuted storage).

Our dense grid runs query blocks fastest, then heads, then batches, so the blocks in flight read
several heads of one batch; FlashAttention-2's grid (m_block, batch, head) runs several batches
of one head. Which K/V rows those are depends on the storage order.

    CUTLASS_FLASH_FORCE_ARCH=80 python lab/layout_l2.py [--head-dims 64,256] [--seqlens 1024,2048,8192]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cutlass_flash
from cutlass_flash.benchmark import attention_flops, time_interleaved


def tensors(batch, seqlen, nheads, d, head_major):
    shape = (batch, nheads, seqlen, d) if head_major else (batch, seqlen, nheads, d)
    t = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return [x.transpose(1, 2) for x in t] if head_major else t  # logical (batch, seqlen, heads, d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,256")
    ap.add_argument("--seqlens", default="1024,2048,8192")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    print("| d | seqlen | storage | ours TFLOPS | FA2 TFLOPS | ours / FA2 |")
    print("|---:|---:|---|---:|---:|---:|")
    for d in map(int, a.head_dims.split(",")):
        for s in map(int, a.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            for head_major in (False, True):
                q, k, v = tensors(b, s, h, d, head_major)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                fns = {
                    "ours": (lambda: cutlass_flash.flash_attn_func(q, k, v), torch.no_grad),
                    "fa2": (lambda: F.scaled_dot_product_attention(qt, kt, vt),
                            lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
                }
                ms = time_interleaved(fns, rounds=a.rounds)
                fl = attention_flops(b, h, s, s, d, False, "fwd")
                t = {k_: fl / m / 1e9 for k_, m in ms.items()}
                name = "b h s d" if head_major else "b s h d"
                ratio = t["ours"] / t["fa2"]
                print(f"| {d} | {s} | {name} | {t['ours']:.1f} | {t['fa2']:.1f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
