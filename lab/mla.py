"""MLA's (192, 128) (issue 33), forward and backward: the sm90 kernels with V's head dim as their
own against the same call on the d = 192 kernels with v (and out, dout) zero-padded, against
FlashAttention-3's (192, 128) where it imports (flash_attn_interface on PYTHONPATH; its backward
runs its d = 192 kernel with V zero-filled) and cuDNN through SDPA; bf16, 16k tokens per batch, 16
heads, causal and not. Each output and gradient is first checked against the padded run's.

    python lab/mla.py [--seqlens 2048,4096,8192] [--modes fwd,bwd] [--out DIR]

TFLOPS by FlashAttention's count with d = (192 + 128) / 2: forward 2 B H S^2 (192 + 128), halved
for causal, backward 2.5x.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cutlass_flash
from cutlass_flash.benchmark import attention_flops, time_interleaved, write_report

try:
    import flash_attn_interface as fa3
except ImportError:
    fa3 = None


def _fwd_and_bwd(fn, q, k, v, dout):
    """fn's out, and a function that runs its backward alone on the kept graph."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return out, bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    names = ["own", "padded"] + (["fa3"] if fa3 is not None else []) + ["cudnn"]
    rows = [f"# MLA (192, 128), {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"FlashAttention-3 {'imported' if fa3 is not None else 'not found'}", "",
            "TFLOPS; ratios of the own kernels' TFLOPS; max diff: against the padded run (out, dq, dk, dv).", "",
            "| mode | seqlen | causal | " + " | ".join(names)
            + " | own / padded | own / FA3 | own / cuDNN | max diff |",
            "|---|---:|---|" + "---:|" * (len(names) + 4)]
    cudnn_ctx = lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    for seqlen in map(int, a.seqlens.split(",")):
        batch, h = max(1, 16384 // seqlen), a.nheads
        g = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k = (torch.randn(batch, seqlen, h, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        v, dout = (torch.randn(batch, seqlen, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(2))
        for causal in (False, True):
            for direction in modes:
                assert cutlass_flash.plan(q, k, direction, v=v).head_dim_v == 128, f"no {direction} kernel of its own"
            impls = {
                "own": lambda q, k, v: cutlass_flash.flash_attn_func(q, k, v, causal=causal),
                "padded": lambda q, k, v: cutlass_flash.flash_attn_func(q, k, F.pad(v, (0, 64)), causal=causal)[
                    ..., :128],
                "cudnn": lambda q, k, v: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2),
            }
            if fa3 is not None:
                impls["fa3"] = lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal)
            fwd_ctx = {n: cudnn_ctx if n == "cudnn" else torch.no_grad for n in impls}
            bwd_ctx = {n: cudnn_ctx if n == "cudnn" else torch.enable_grad for n in impls}
            # Forward calls under their context; each backward on a graph built once.
            fwd, bwd, ref = {}, {}, None
            for n in names:
                try:
                    if "bwd" in modes:
                        with bwd_ctx[n]():
                            out, run_bwd = _fwd_and_bwd(impls[n], q, k, v, dout)
                            got = (out.detach(),) + run_bwd()
                    else:  # also a forward-only build's (CUTLASS_FLASH_FWD_ONLY)
                        with fwd_ctx[n]():
                            got, run_bwd = (impls[n](q, k, v),), None
                except RuntimeError as e:
                    print(f"{n}: {str(e)[:160]}")
                    continue
                if n == "padded":
                    ref = got
                fwd[n] = (lambda f=impls[n]: f(q, k, v), fwd_ctx[n])
                bwd[n] = (run_bwd, bwd_ctx[n])
                if n == "own":
                    own = got
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(own, ref))
            for mode in modes:
                ms = time_interleaved(fwd if mode == "fwd" else bwd, rounds=7)
                flops = attention_flops(batch, h, seqlen, seqlen, (192 + 128) / 2, causal, mode)
                t = {n: flops / m / 1e9 for n, m in ms.items()}
                cells = " | ".join(f"{t[n]:.0f}" if n in t else "-" for n in names)
                ratios = " | ".join(f"{t['own'] / t[n]:.3f}" if n in t else "-" for n in ("padded", "fa3", "cudnn"))
                rows.append(f"| {mode} | {seqlen} | {'yes' if causal else 'no'} | {cells} | {ratios} | {diff:.2e} |")
                print(rows[-1], flush=True)
    write_report("\n".join(rows) + "\n", a.out, "mla.md")


if __name__ == "__main__":
    main()
