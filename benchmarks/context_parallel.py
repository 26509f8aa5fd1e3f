"""One long sequence over several GPUs, on our kernels, through two engines:

- PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel) with
  cutlass_flash active as SDPA's flash implementation (cutlass_flash.sdpa), against the same with
  PyTorch's own flash kernels;
- ring-flash-attn's zigzag ring (PyPI ring-flash-attn) on our kernels
  (cutlass_flash.integrations.ring_flash_attn).

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --out results/

First the check: out and the gradients of q, k, v of each engine, unsharded, against the float64
reference by the accuracy rule (beside our single-GPU op), causal and not, MHA and GQA. Then the
speed of forward + backward (bf16, head dim 128, causal) at each --seqlens: our single-GPU op,
each engine, their speed-up over one GPU and their peak memory per GPU against the single-GPU run.
Writes context-parallel.md to --out (rank 0).
"""

import argparse
import contextlib
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import attention

import cutlass_flash
from cutlass_flash.benchmark import write_report
from cutlass_flash.integrations.ring_flash_attn import install

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from attn_ref import assert_within_tolerance, reference_outputs, slack  # noqa: E402


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def inputs(seqlen, nheads, nheads_kv, head_dim, seed=0):
    """q, k, v, dout (1, S, H, D) bf16, the same on every rank."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(1, seqlen, nheads, head_dim), (1, seqlen, nheads_kv, head_dim), (1, seqlen, nheads_kv, head_dim),
              (1, seqlen, nheads, head_dim)]
    return [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes]


@contextlib.contextmanager
def context_parallel_shards(mesh, q, k, v, dout, causal, backend):
    """Inside: the (B, H, S/world, D) shards of q, k, v, dout in the load balancer's order, under
    context_parallel with SDPA's flash backend on `backend`: "cutlass_flash" or "pytorch" (its
    default flash kernels)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    # Load balancing (head-tail order) is for causal masks only; the shards stay in order without.
    _cp_options.enable_load_balance = causal
    if backend == "cutlass_flash":
        attention.activate_flash_attention_impl(cutlass_flash.sdpa.NAME)
    try:
        bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]  # (B, H, S, D)
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
                yield bufs
    finally:
        if backend == "cutlass_flash":
            attention.restore_flash_attention_impl()


def attention_step(bufs, causal):
    """Forward + backward of SDPA on the shards; the local out, dq, dk, dv."""
    ql, kl, vl = (t.detach().requires_grad_() for t in bufs[:3])
    out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal, enable_gqa=kl.shape[1] != ql.shape[1])
    out.backward(bufs[3])
    return out.detach(), ql.grad, kl.grad, vl.grad


def run_context_parallel(mesh, q, k, v, dout, causal, backend):
    """Forward + backward of SDPA under context_parallel on (1, S, H, D) tensors, the sharding of
    the four full tensors included. Returns the local out, dq, dk, dv (B, H, S/world, D) in the
    load balancer's order."""
    with context_parallel_shards(mesh, q, k, v, dout, causal, backend) as bufs:
        return attention_step(bufs, causal)


def zigzag(t, rank, world):
    """Rank r's chunks r and 2 world - 1 - r of the sequence (dim 1), ring-flash-attn's zigzag."""
    chunks = t.chunk(2 * world, dim=1)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=1).contiguous()


def gather(local, world):
    """Every rank's `local`, in rank order."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return parts


def unzigzag(local, world):
    """The full sequence from every rank's zigzag chunks."""
    parts = gather(local, world)
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=1)
        chunks[r], chunks[2 * world - 1 - r] = a, b
    return torch.cat(chunks, dim=1)


def run_ring(ring, q, k, v, dout, causal):
    """ring-flash-attn's zigzag ring under a causal mask (its load balancing), its plain ring on
    contiguous shards without one (zigzag refuses causal=False)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = zigzag if causal else (lambda t, r, w: t.chunk(w, dim=1)[r].contiguous())
    fn = ring.zigzag_ring_flash_attn_func if causal else ring.ring_flash_attn_func
    ql, kl, vl = (shard(t, rank, world).requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl, causal=causal)
    out.backward(shard(dout, rank, world))
    return out.detach(), ql.grad, kl.grad, vl.grad


def unshard_ring(local, world, causal):
    return unzigzag(local, world) if causal else torch.cat(gather(local, world), dim=1)


def check(mesh, ring, seqlen, nheads, nheads_kv, causal):
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    q, k, v, dout = inputs(seqlen, nheads, nheads_kv, 128, seed=seqlen + nheads_kv)
    world = dist.get_world_size()
    cp = run_context_parallel(mesh, q, k, v, dout, causal, "cutlass_flash")
    cp = [t.transpose(1, 2) for t in context_parallel_unshard(mesh, list(cp), [2, 2, 2, 2])]
    rg = [unshard_ring(t, world, causal) for t in run_ring(ring, q, k, v, dout, causal)] if ring is not None else None
    if dist.get_rank() != 0:
        return []
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    single = cutlass_flash.flash_attn_func(*leaves, causal=causal)
    single = [single.detach()] + list(torch.autograd.grad(single, leaves, dout))
    ref = reference_outputs(q, k, v, dout, causal=causal, dtype=torch.float64)
    same = reference_outputs(q, k, v, dout, causal=causal)
    ref, same = [ref[0]] + list(ref[2:]), [same[0]] + list(same[2:])
    rows = []
    for engine, ours in (("single GPU", single), ("context_parallel", cp), ("ring-flash-attn", rg)):
        if ours is None:
            continue
        errs, verdict = [], "met"
        for name, o, s, r in zip(("out", "dq", "dk", "dv"), ours, same, ref):
            try:
                assert_within_tolerance(f"{engine} S={seqlen} Hkv={nheads_kv} causal={causal}: {name}", o, s, r,
                                        slack=slack(name, seqlen * nheads // nheads_kv, 128))
            except AssertionError as e:
                verdict = f"missed ({e})"
            errs.append((o.double() - r).abs().max().item() / max((s.double() - r).abs().max().item(), 1e-30))
        rows.append(f"| {engine} | {seqlen} | {nheads}/{nheads_kv} | {'yes' if causal else 'no'} | "
                    + " | ".join(f"{e:.2f}" for e in errs) + f" | {verdict} |")
    return rows


def timed(fn, reps):
    """Median milliseconds of fn over reps (after one warm-up), and the peak memory (GiB) of a call."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    dist.barrier()
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def speed(mesh, ring, seqlen, nheads, reps):
    """Each run holds what it needs: the single GPU and context_parallel (whose buffers are the full
    tensors, sharded in place) the full sequence, the ring its own zigzag shards only."""
    q, k, v, dout = inputs(seqlen, nheads, nheads, 128)

    def single():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = cutlass_flash.flash_attn_func(*leaves, causal=True)
        out.backward(dout)

    runs = {"single GPU (ours)": single}
    for backend in ("cutlass_flash", "pytorch"):
        runs[f"context_parallel ({backend})"] = (
            lambda backend=backend: run_context_parallel(mesh, q, k, v, dout, True, backend))
    results = {}
    for name, fn in runs.items():
        try:
            results[name] = timed(fn, reps)
        except Exception as e:
            log(f"{name} at {seqlen}: {type(e).__name__}: {str(e)[:300]}")
            results[name] = (float("nan"), float("nan"))
    # Per attention call, the shards made once: what each layer of a model pays, whose inputs
    # context_parallel shards once per step. The rows above shard the four full tensors in every
    # call: at 128k tokens that gather and its copies took about 15 of rank 0's 237 ms
    # (results/cp-profile-131072-99.txt).
    def per_call(backend):  # the shards live in this frame only, not through the ring's run
        with context_parallel_shards(mesh, q, k, v, dout, True, backend) as bufs:
            return timed(lambda: attention_step(bufs, True), reps)

    for backend in ("cutlass_flash", "pytorch"):
        name = f"context_parallel ({backend}), per call"
        try:
            results[name] = per_call(backend)
        except Exception as e:
            log(f"{name} at {seqlen}: {type(e).__name__}: {str(e)[:300]}")
            results[name] = (float("nan"), float("nan"))
    if ring is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
        local = [zigzag(t, rank, world) for t in (q, k, v, dout)]
        del q, k, v, dout, runs
        torch.cuda.empty_cache()

        def ring_step():
            ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
            out = ring.zigzag_ring_flash_attn_func(ql, kl, vl, causal=True)
            out.backward(local[3])

        results["ring-flash-attn zigzag (ours)"] = timed(ring_step, reps)
    flops = 4 * seqlen * seqlen * nheads * 128 / 2 * 3.5  # forward + backward (2.5x), causal halved
    base_ms, base_mem = results["single GPU (ours)"]
    rows = []
    for name, (ms, mem) in results.items():
        rows.append(f"| {seqlen} | {name} | {ms:.1f} | {flops / ms / 1e9:.0f} | {base_ms / ms:.2f} | {mem:.2f} | "
                    f"{mem / base_mem:.2f} |")
    return rows


def speedup_svg(rows):
    """A bar chart (SVG, no plotting library) of the speed-up over one GPU by sequence length, from
    the speed table's rows."""
    data = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) >= 5 and cells[0].isdigit() and "single" not in cells[1]:
            data.setdefault(cells[1], {})[int(cells[0])] = float(cells[4])
    seqlens = sorted({n for runs in data.values() for n in runs})
    colors = ["#1f77b4", "#aaaaaa", "#17becf", "#dddddd", "#d62728", "#2ca02c"]
    width, height, left, bottom, top = 560, 300, 50, 40, 20
    group = (width - left - 20) / max(len(seqlens), 1)
    bar = group * 0.8 / max(len(data), 1)
    ymax = 2.0

    def y(v):
        return top + (height - top - bottom) * (1 - v / ymax)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20 * len(data)}" '
             'font-family="sans-serif" font-size="12">']
    for v in (0.5, 1.0, 1.5, 2.0):
        parts.append(f'<line x1="{left}" x2="{width - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}x</text>')
    for i, n in enumerate(seqlens):
        x0 = left + i * group + group * 0.1
        for j, (name, runs) in enumerate(data.items()):
            if n in runs:
                v = runs[n]
                parts.append(f'<rect x="{x0 + j * bar:.1f}" y="{y(v):.1f}" width="{bar * 0.9:.1f}" '
                             f'height="{y(0) - y(v):.1f}" fill="{colors[j % len(colors)]}"/>'
                             f'<text x="{x0 + (j + 0.45) * bar:.1f}" y="{y(v) - 4:.1f}" text-anchor="middle">{v:.2f}'
                             '</text>')
        parts.append(f'<text x="{x0 + group * 0.4:.1f}" y="{height - bottom + 18}" text-anchor="middle">'
                     f'{n // 1024}k tokens</text>')
    for j, name in enumerate(data):
        yy = height + 20 * j
        parts.append(f'<rect x="{left}" y="{yy - 10}" width="12" height="12" fill="{colors[j % len(colors)]}"/>'
                     f'<text x="{left + 18}" y="{yy}">{name}: speed-up over our op on one GPU</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="131072,262144")
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--check-seqlen", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot-from", default=None, help="only redraw the SVG from a context-parallel.md")
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather",
                        help="context_parallel's rotation of K / V (set_rotate_method); default its own")
    parser.add_argument("--skip-check", action="store_true", help="only the speed")
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            svg = speedup_svg(f.read().splitlines())
        with open(os.path.splitext(args.plot_from)[0] + ".svg", "w") as f:
            f.write(svg)
        return

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(args.rotate)
    try:
        ring = install()
    except ImportError as e:  # ring-flash-attn not installed: its rows say so
        log(f"ring-flash-attn: {e}")
        ring = None
    lines = [
        "# Context parallelism on our kernels", "",
        f"- {world} x {torch.cuda.get_device_name()}; torch {torch.__version__}; cutlass_flash "
        f"{cutlass_flash.__version__}; {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- context_parallel: rotation {args.rotate}, load balancing; ring-flash-attn: zigzag", "",
        "## Check: error / PyTorch's same-dtype error against float64 (the rule: <= 2)", "",
        "| engine | seqlen | heads q/kv | causal | out | dq | dk | dv | rule |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for nheads_kv in () if args.skip_check else (8, 2):
        for causal in (False, True):
            try:
                rows = check(mesh, ring, args.check_seqlen, 8, nheads_kv, causal)
            except Exception as e:  # a failed check is reported, and the run goes on
                rows = [f"| failed | {args.check_seqlen} | 8/{nheads_kv} | {causal} | {type(e).__name__}: "
                        f"{str(e)[:300]} | | | |"]
            lines += rows
            for r in rows:
                log(r)
    lines += ["", f"## Speed: forward + backward, bf16, {args.nheads} heads of 128, causal, batch 1", "",
              "| seqlen | run | ms | TFLOPS (per run) | x single GPU | peak GiB per GPU | x single GPU's |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        rows = speed(mesh, ring, seqlen, args.nheads, args.reps)
        lines += rows
        for r in rows:
            log(r)
    if rank == 0:
        write_report("\n".join(lines) + "\n", args.out, "context-parallel.md")
        if args.out:
            with open(os.path.join(args.out, "context-parallel.svg"), "w") as f:
                f.write(speedup_svg(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
