"""Where the time of one forward + backward goes under PyTorch's context_parallel with our kernels
as SDPA's flash implementation, against our op on one GPU (issue 34's 128k gap): CUDA time per
kernel name on rank 0, from torch.profiler, one profiled call after two warm-up calls each.

    torchrun --nproc-per-node 2 lab/cp_profile.py [--seqlen 131072] [--out DIR]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import cutlass_flash
from cutlass_flash.benchmark import write_report

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from context_parallel import inputs, run_context_parallel  # noqa: E402


def table(prof, rows=22):
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    q, k, v, dout = inputs(a.seqlen, a.nheads, a.nheads, 128)

    def single():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = cutlass_flash.flash_attn_func(*leaves, causal=True)
        out.backward(dout)

    runs = {"single": single, "cp": lambda: run_context_parallel(mesh, q, k, v, dout, True, "cutlass_flash")}
    text = []
    for name, fn in runs.items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        dist.barrier()
        text.append(f"## {name}, seqlen {a.seqlen}, rank {rank}\n\n" + table(prof))
    if rank == 0:
        write_report("\n\n".join(text), a.out, f"cp-profile-{a.seqlen}.txt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
