"""The persistent tile scheduler's mapping (csrc/kernels/common/tile_order.h), checked on the
host: every (query block, head, batch) tile exactly once, and with a causal mask the longest tiles
first inside each group of heads. Compiled with nvcc (host code only); skipped without it."""

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"

PROGRAM = r"""
#include "kernels/common/tile_order.h"
#include <algorithm>
#include <cstdio>
#include <vector>
using namespace cutlass_flash;

int main() {
  int configs = 0, errors = 0;
  for (int num_blocks : {1, 3, 16, 17})
    for (int nheads : {1, 5, 16})
      for (int batch : {1, 2, 7})
        for (bool causal : {false, true})
          for (int group : {0, 1, 4, 100}) {  // 0: the launcher's choice
            const int pairs = nheads * batch;
            if (group == 0) {
              group = PersistentTileOrder::group_size(pairs);
              if (group < 1 || group > pairs) ++errors;
            }
            if (PersistentTileOrder::grid_size(num_blocks * pairs, 132) != std::min(num_blocks * pairs, 132)) ++errors;
            const PersistentTileOrder s(num_blocks, nheads, batch, causal, group);
            std::vector<int> seen(s.num_tiles, 0);
            int prev_group = 0, prev_block = num_blocks;
            for (int t = 0; t < s.num_tiles; ++t) {
              const TileCoord c = s.coord(t);
              if (c.block < 0 || c.block >= num_blocks || c.head < 0 || c.head >= nheads || c.batch < 0 ||
                  c.batch >= batch) {
                ++errors;
                continue;
              }
              ++seen[(c.batch * nheads + c.head) * num_blocks + c.block];
              if (causal) {  // inside a group, query blocks never increase
                const int g = (c.batch * nheads + c.head) / group;
                if (g == prev_group && c.block > prev_block) ++errors;
                if (g < prev_group) ++errors;
                prev_group = g;
                prev_block = c.block;
              }
            }
            for (int n : seen) errors += n != 1;
            ++configs;
          }
  std::printf("configs=%d errors=%d\n", configs, errors);
  return errors != 0;
}
"""


def test_every_tile_once_longest_first_per_group(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "sched.cu"
    src.write_text(PROGRAM)
    exe = tmp_path / "sched"
    subprocess.run([nvcc, "-std=c++17", "-I", str(CSRC), "-I", str(CSRC / "include"), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "configs=288 errors=0"
