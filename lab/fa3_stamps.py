"""FlashAttention-3's per-tile timeline of its (192, 128) forward, beside ours (lab/fwd_stamps.py):
the same clock stamps at the same points of each consumer warpgroup's tile, from a lab build of
FlashAttention-3 with lab/fa3_stamps.patch (lab/device_fa3.sh with FA3_PATCH=lab/fa3_stamps.patch,
on PYTHONPATH). The patch appends each launch's stamps to the file FA3_LAB_STAMPS names.

    python lab/fa3_stamps.py [--cells 2048:0,2048:1,8192:0] [--out DIR]

Stamps as fwd_stamps.py's, with one difference: stamp 4 comes after the softmax's final row sums
(FlashAttention-3 waits for its last P V GEMM after them), so its "last PV" holds part of what ours
counts in "store". With --out, the raw stamps go there too (lab/stamps_fit.py).
"""
import os
import tempfile

import numpy as np
import torch

import flash_attn_interface as fa3
from cutlass_flash.benchmark import write_report
from fwd_stamps import TIMELINE_HEADER, cells, parse_args, save_raw, timeline_rows

CTAS, WGS, TILES, STAMPS = 132, 2, 64, 8  # lab_stamps.h of the patch


def stamps_of_one_call(q, k, v, causal):
    """The stamps of one forward call (the call before it zeroes them)."""
    path = os.path.join(tempfile.mkdtemp(), "fa3_stamps.bin")
    os.environ["FA3_LAB_STAMPS"] = path
    try:
        fa3.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        os.remove(path)
        fa3.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
    finally:
        del os.environ["FA3_LAB_STAMPS"]
    raw = np.fromfile(path, dtype=np.int64)
    n = CTAS * WGS * TILES * STAMPS
    assert raw.size == n, f"expected one launch's stamps ({n}), read {raw.size}: is the patch built in?"
    return raw.reshape(CTAS, WGS, TILES, STAMPS).astype(np.float64)


def main():
    a = parse_args()
    dims = a.dims.replace(":", ", ")
    rows = [f"# FlashAttention-3 ({dims}) forward per-tile timeline, {torch.cuda.get_device_name()} "
            "(SM cycles; lab/fa3_stamps.patch)", ""] + TIMELINE_HEADER
    for seqlen, causal, q, k, v in cells(a.cells, a.dims):
        for _ in range(3):
            fa3.flash_attn_func(q, k, v, causal=causal)
        s = stamps_of_one_call(q, k, v, causal)
        save_raw(s, a.out, "fa3", seqlen, causal)
        for row in timeline_rows(s, seqlen, causal):
            rows.append(row)
            print(row, flush=True)
    write_report("\n".join(rows) + "\n", a.out, "fa3_stamps.md")


if __name__ == "__main__":
    main()
