"""Per-tile cost of the (192, 128) forward as a line in the tile's key blocks, from the raw stamps
that lab/fwd_stamps.py and lab/fa3_stamps.py save with --out (IMPL-SEQLEN-CAUSAL.npy).

    python lab/stamps_fit.py DIR [DIR ...] [--out DIR]

A tile's cost is the SM cycles from the warpgroup's previous O staged (stamp 5) to this one's:
everything the warpgroup spends on it, the wait for its Q included. Fitting cost = fixed + per_block
x blocks over every tile of every block separates what a tile costs once (Q, the first and last
key block, the store) from what each further key block costs, which the timeline's means mix
when tiles differ in length (causal). The first block's part: its S done (stamp 2) to the first
loop step's V ready (stamp 7).
"""
import argparse
import glob
import os

import numpy as np

from cutlass_flash.benchmark import write_report


def tiles(s, wg):
    """(cost, blocks, first) of every tile after the first of each block: s is (blocks, warpgroups,
    tiles, 8) of SM clock stamps (0 where not stamped)."""
    cost, blocks, first = [], [], []
    for c in range(s.shape[0]):
        t = s[c, wg]
        for i in range(1, s.shape[2]):
            if t[i, 5] == 0 or t[i - 1, 5] == 0 or t[i, 6] < 2:
                continue
            cost.append(t[i, 5] - t[i - 1, 5])
            blocks.append(t[i, 6])
            first.append(t[i, 7] - t[i, 2] if t[i, 7] else np.nan)
    return np.array(cost, float), np.array(blocks, float), np.array(first, float)


HEADER = ["| run | impl | seqlen | causal | wg | tiles | blocks/tile | cost/tile | per block | fixed | "
          "first block (S done to V) | residual (rms) |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


def fit(cost, blocks):
    """(per block, fixed, rms residual); tiles of one length (no mask) give only the mean as fixed."""
    if np.ptp(blocks) == 0:
        return np.nan, cost.mean(), np.sqrt(np.mean((cost - cost.mean()) ** 2))
    slope, fixed = np.polyfit(blocks, cost, 1)
    return slope, fixed, np.sqrt(np.mean((cost - slope * blocks - fixed) ** 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = ["# (192, 128) forward: per-tile cost = fixed + per block x key blocks (SM cycles, lab/stamps_fit.py)",
            ""] + HEADER
    for d in a.dirs:
        run = os.path.basename(os.path.normpath(d))
        for path in sorted(glob.glob(os.path.join(d, "*.npy"))):
            impl, seqlen, causal = os.path.basename(path)[:-4].rsplit("-", 2)
            s = np.load(path).astype(np.float64)
            for wg in range(2):
                cost, blocks, first = tiles(s, wg)
                if cost.size < 3:
                    continue
                slope, fixed, rms = fit(cost, blocks)
                first_mean = np.nanmean(first) if np.isfinite(first).any() else float("nan")
                rows.append(f"| {run} | {impl} | {seqlen} | {'yes' if causal == '1' else 'no'} | {wg} | {cost.size} | "
                            f"{blocks.mean():.1f} | {cost.mean():.0f} | {slope:.0f} | {fixed:.0f} | {first_mean:.0f} | "
                            f"{rms:.0f} |")
    write_report("\n".join(rows) + "\n", a.out, "stamps_fit.md")


if __name__ == "__main__":
    main()
