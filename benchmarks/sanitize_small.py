"""A small forward + backward per built head dim, causal and not, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python benchmarks/sanitize_small.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_small.py

Sizes are awkward on purpose (partial query and key blocks, seqlen_q != seqlen_k, GQA).
"""
import sys

import torch

import cutlass_flash


def main():
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    dims = sorted({d for (a, direction, d, dt) in cutlass_flash.built_kernels() if direction == "bwd"})
    torch.manual_seed(0)
    for d in dims:
        for causal in (False, True):
            q = torch.randn(1, 77, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, 131, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            with cutlass_flash.force_arch(arch):
                out = cutlass_flash.flash_attn_func(q, k, v, causal=causal)
                out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            print(f"d={d} causal={causal}: finite={bool(torch.isfinite(q.grad).all())}", flush=True)


if __name__ == "__main__":
    main()
