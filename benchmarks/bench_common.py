"""What the scripts of benchmarks/ and lab/ share beyond cutlass_flash.benchmark (which has the
timing, the FLOP count, the environment and the report writing): the two timed calls of a
forward, and FlashAttention-3's line for the environment with the commits it was built from."""
import os

import torch

from cutlass_flash import benchmark as bench


def fwd_and_fwdbwd(fn, qkv, dout):
    """The two timed calls of the benchmark scripts (benchmarks/*_bench.py) for fn(*qkv): the
    forward without grad, and forward + backward for dout (fn may return (out, ...))."""
    def fwd():
        with torch.no_grad():
            return fn(*qkv)

    def fwdbwd():
        out = fn(*qkv)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, qkv, dout)

    return fwd, fwdbwd


def fa3_info():
    """cutlass_flash.benchmark.fa3_info() with the source commits of SOURCE.txt (written by
    lab/pack_fa3src.sh at the top of the tree that holds FA3's hopper/), where it is there."""
    text, fa3 = bench.fa3_info(), bench._fa3_interface()
    if fa3 is None:
        return text
    source = os.path.join(os.path.dirname(os.path.abspath(fa3.__file__)), os.pardir, "SOURCE.txt")
    try:
        with open(source) as f:
            commits = [line.split() for line in f if line.strip()]
    except OSError:
        return text
    return text + "".join(f"; {c[0]} {c[1][:12]}" for c in commits if len(c) >= 2)
