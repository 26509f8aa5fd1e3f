"""Per-tile timeline of the sm90 forward's consumer warpgroups from SM clock stamps, MLA's
(192, 128) unless --dims says otherwise (kernels of two consumer warpgroups: d = 128, 192, 256),
bf16, 16k tokens, 16 heads, on a lab build: lab/fwd_stamps.patch applied (git apply;
it adds csrc/kernels/sm90/lab_stamps.h and the stamps) and the kernels built with
CUTLASS_FLASH_NVCC_FLAGS=-DCUTLASS_FLASH_LAB_STAMPS and only that head dim's forward
(CUTLASS_FLASH_ARCHS=90 CUTLASS_FLASH_HEAD_DIMS=192 CUTLASS_FLASH_DTYPES=bf16
CUTLASS_FLASH_FWD_ONLY=1, or HEAD_DIMS=128 for --dims 128:128: the stamps live in that
translation unit):

    python lab/fwd_stamps.py [--cells 2048:0,2048:1,8192:0] [--dims 192:128] [--out DIR]

Stamps per tile and warpgroup: 0 tile received (Q landed), 1 before the first S GEMM, 2 its S
done, 7 the first loop step's V ready, 3 loop end (then Q's release), 4 last P V done, 5 O staged;
6 the key blocks. The tile thread's (row 2): 6 before handing the tile to the K/V thread, 0 after,
1 / 3 warpgroup 0's / 1's slab of Q free, 2 / 4 its TMA load issued.
"""
import argparse
import ctypes
import os

import numpy as np
import torch

import cutlass_flash
from cutlass_flash.benchmark import write_report

CTAS, WGS, TILES, STAMPS = 132, 3, 64, 8  # WGS: two consumer warpgroups and the tile thread


def parse_args():
    """The command line of this script and lab/fa3_stamps.py (the same cells for both timelines)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="2048:0,2048:1,8192:0")
    ap.add_argument("--dims", default="192:128", help="D:DV, the head dims of Q and K, and of V")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main():
    a = parse_args()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(cutlass_flash.__file__), "libcutlass_flash_kernels.so"))
    n = CTAS * WGS * TILES * STAMPS
    buf = (ctypes.c_longlong * n)()
    stamps_fn = getattr(lib, "_ZN13cutlass_flash10lab_stampsEPxxi")  # cutlass_flash::lab_stamps
    stamps_fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int]
    qrows = []
    dims = a.dims.replace(":", ", ")
    rows = [f"# sm90 forward ({dims}) per-tile timeline, {torch.cuda.get_device_name()} (SM cycles)", ""]
    rows += TIMELINE_HEADER
    for seqlen, causal, q, k, v in cells(a.cells, a.dims):
        for _ in range(3):
            cutlass_flash.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        assert stamps_fn(None, 0, 1) == 0
        cutlass_flash.flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        assert stamps_fn(ctypes.addressof(buf), n, 0) == 0
        s = np.frombuffer(buf, dtype=np.int64).reshape(CTAS, WGS, TILES, STAMPS).astype(np.float64)
        save_raw(s, a.out, "own", seqlen, causal)
        for row in timeline_rows(s, seqlen, causal):
            rows.append(row)
            print(row, flush=True)
        qrows.append(q_handoff(s, seqlen, causal))
        print(qrows[-1], flush=True)
    rows += ["", "Q's hand-off per tile (cycles, means): free = from the warpgroup's release of the previous "
             "tile's Q (its loop end) to the tile thread past q_empty; early = the tile thread waiting "
             "there before the release (negative: it came later); load = from the slab's TMA load issued "
             "to the warpgroup past q_full; claim = the tile thread from the previous tile's last load to "
             "its hand-over of this one (the tile counter's atomic), hand-over = waiting for the K/V "
             "thread to take the previous tile.", "",
             "| seqlen | causal | tiles | wg 0 free | wg 0 early | wg 0 load | wg 1 free | wg 1 early | wg 1 load "
             "| claim | hand-over |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + qrows
    write_report("\n".join(rows) + "\n", a.out, "fwd_stamps.md")


def save_raw(s, out, impl, seqlen, causal):
    """The stamps as IMPL-SEQLEN-CAUSAL.npy under out (read by lab/stamps_fit.py)."""
    if out:
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, f"{impl}-{seqlen}-{int(causal)}.npy"), s.astype(np.int64))


def cells(spec, dims="192:128"):
    """(seqlen, causal, q, k, v) of each SEQLEN:CAUSAL cell of spec at head dims D:DV (Q and K's,
    V's), bf16, 16k tokens a batch, 16 heads (lab/fa3_stamps.py times FlashAttention-3 on the same
    cells). The stamps' layout fits kernels of two consumer warpgroups (d = 128, 192, 256)."""
    d, dv = (int(x) for x in dims.split(":"))
    for cell in spec.split(","):
        seqlen, causal = int(cell.split(":")[0]), bool(int(cell.split(":")[1]))
        b, h = 16384 // seqlen, 16
        q, k = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, seqlen, h, dv, device="cuda", dtype=torch.bfloat16)
        yield seqlen, causal, q, k, v


#: The timeline table's legend and header (lab/fa3_stamps.py prints FlashAttention-3's with them).
TIMELINE_HEADER = [
    "Means over tiles (cycles): recv = from the warpgroup's previous O staged to this tile's Q; "
    "first S = the first S GEMM (K wait, turn, GEMM); to V = first S done to the first loop "
    "step's V ready; step = loop time / its steps; last PV; store = O staged. Share: of the "
    "summed span of every block (first receive to last store).", "",
    "| seqlen | causal | wg | tiles | steps/tile | recv | first S | to V | step | last PV | store | "
    "loop share | overhead share |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def timeline_rows(s, seqlen, causal):
    """The timeline table's rows of both consumer warpgroups from stamps s (blocks, warpgroups,
    tiles, 8) numbered as this file's docstring says (stamp 7 absent: "to V" is -)."""
    rows = []
    for wg in range(2):
        acc = {k: [] for k in ("recv", "first", "tov", "step", "lastpv", "store", "steps")}
        loop_tot = span_tot = 0.0
        for c in range(s.shape[0]):
            t = s[c, wg]
            valid = [i for i in range(s.shape[2]) if t[i, 0] != 0 and t[i, 5] != 0 and t[i, 6] > 1]
            if not valid:
                continue
            span_tot += t[valid[-1], 5] - t[valid[0], 0]
            for i in valid:
                steps = t[i, 6]
                if i > 0 and t[i - 1, 5] != 0:
                    acc["recv"].append(t[i, 0] - t[i - 1, 5])
                acc["first"].append(t[i, 2] - t[i, 1])
                if t[i, 7] != 0:
                    acc["tov"].append(t[i, 7] - t[i, 2])
                acc["step"].append((t[i, 3] - t[i, 2]) / (steps - 1))
                acc["lastpv"].append(t[i, 4] - t[i, 3])
                acc["store"].append(t[i, 5] - t[i, 4])
                acc["steps"].append(steps)
                loop_tot += t[i, 3] - t[i, 2]
        m = {k: f"{np.mean(x):.0f}" if x else "-" for k, x in acc.items()}
        share = loop_tot / span_tot if span_tot else float("nan")
        rows.append(f"| {seqlen} | {'yes' if causal else 'no'} | {wg} | {len(acc['steps'])} | "
                    f"{np.mean(acc['steps']) if acc['steps'] else float('nan'):.1f} | {m['recv']} | {m['first']} | "
                    f"{m['tov']} | {m['step']} | {m['lastpv']} | {m['store']} | {share:.3f} | {1 - share:.3f} |")
    return rows


def q_handoff(s, seqlen, causal):
    """One row of the Q hand-off table from the stamps of every block (tiles 1.. of each)."""
    acc = {k: [] for k in ("free0", "early0", "load0", "free1", "early1", "load1", "claim", "hand")}
    for c in range(CTAS):
        w0, w1, t = s[c, 0], s[c, 1], s[c, 2]
        for i in range(1, TILES):
            if not (w0[i, 0] and w1[i, 0] and w0[i - 1, 3] and w1[i - 1, 3] and t[i, 4] and t[i - 1, 4]):
                continue
            acc["free0"].append(t[i, 1] - w0[i - 1, 3])
            acc["early0"].append(w0[i - 1, 3] - t[i, 0])
            acc["load0"].append(w0[i, 0] - t[i, 2])
            acc["free1"].append(t[i, 3] - w1[i - 1, 3])
            acc["early1"].append(w1[i - 1, 3] - t[i, 2])
            acc["load1"].append(w1[i, 0] - t[i, 4])
            acc["claim"].append(t[i, 6] - t[i - 1, 4])
            acc["hand"].append(t[i, 0] - t[i, 6])
    m = {k: float(np.mean(x)) if x else float("nan") for k, x in acc.items()}
    return (f"| {seqlen} | {'yes' if causal else 'no'} | {len(acc['hand'])} | {m['free0']:.0f} | {m['early0']:.0f} | "
            f"{m['load0']:.0f} | {m['free1']:.0f} | {m['early1']:.0f} | {m['load1']:.0f} | {m['claim']:.0f} | "
            f"{m['hand']:.0f} |")


if __name__ == "__main__":
    main()
