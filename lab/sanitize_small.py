"""A small forward + backward per built head dim, causal and not, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python lab/sanitize_small.py
    compute-sanitizer --tool racecheck python lab/sanitize_small.py

Sizes are awkward on purpose (partial query and key blocks, seqlen_q != seqlen_k both ways, GQA).
The second shape has more query tiles (4 x 4 x 9 = 144 at 128 rows) than an H100/H200 has SMs, so
the persistent sm90 kernel takes a second tile on some blocks (Q and O shared memory reused), and
with causal, query rows that see no key. Pass 80 or 90 to force a kernel family, and a comma-separated
list of head dims to check only those (default: every head dim with a built backward; D:DV gives
v a head dim of its own, e.g. 192:128, MLA's); a third
argument `det` runs the backward with deterministic=True (the dQ semaphores), `dropout` with
dropout_p = 0.3 (the Philox mask, the sm90 forward's dropout kernels), `fwd` the forward only (a
library built with CUTLASS_FLASH_FWD_ONLY=1), `varlen` runs
variable-length batches instead, with good and with bad cu_seqlens (past the tensors, decreasing),
which the kernels must clamp.
"""
import sys

import torch

import cutlass_flash


def main():
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    dims = sorted({(d, d) for (a, direction, d, dt) in cutlass_flash.built_kernels() if direction == "bwd"})
    if len(sys.argv) > 2:
        dims = [(int(d), int(dv or d)) for d, _, dv in (x.partition(":") for x in sys.argv[2].split(","))]
    deterministic = len(sys.argv) > 3 and sys.argv[3] == "det"
    dropout_p = 0.3 if len(sys.argv) > 3 and sys.argv[3] == "dropout" else 0.0
    forward_only = len(sys.argv) > 3 and sys.argv[3] == "fwd"
    if len(sys.argv) > 3 and sys.argv[3] == "varlen":
        return varlen(arch, dims)
    torch.manual_seed(0)
    shapes = ((1, 77, 131), (4, 1100, 600))  # (batch, seqlen_q, seqlen_k)
    cases = [(d, shape, causal) for d in dims for shape in shapes for causal in (False, True)]
    for (d, dv), (batch, seqlen_q, seqlen_k), causal in cases:
        q = torch.randn(batch, seqlen_q, 4, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k = torch.randn(batch, seqlen_k, 2, d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn(batch, seqlen_k, 2, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with cutlass_flash.force_arch(arch):
            out = cutlass_flash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                                dropout_p=dropout_p)
            if not forward_only:
                out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        result = out if forward_only else q.grad
        print(f"d={d}:{dv} {batch}x{seqlen_q}x{seqlen_k} causal={causal}: "
              f"finite={bool(torch.isfinite(result).all())}", flush=True)

def varlen(arch, dims):
    torch.manual_seed(0)
    lengths_q, lengths_k = (1, 77, 0, 300), (50, 1, 9, 260)
    for d, dv in dims:
        for cu_q, cu_k in (((0, 1, 78, 78, 378), (0, 50, 51, 60, 320)),
                           ((0, 200, 100, 5000, 378), (-3, 50, 10, 320, 9999))):
            q = torch.randn(sum(lengths_q), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(sum(lengths_k), 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(sum(lengths_k), 2, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            cq = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
            ck = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
            for causal in (False, True):
                with cutlass_flash.force_arch(arch):
                    out = cutlass_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lengths_q), max(lengths_k),
                                                               causal=causal)
                    out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                print(f"varlen d={d}:{dv} cu_q={cu_q} causal={causal}: finite={bool(torch.isfinite(q.grad).all())}",
                      flush=True)


if __name__ == "__main__":
    main()
