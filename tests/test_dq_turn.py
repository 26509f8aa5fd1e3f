"""The deterministic dQ order's turn count (csrc/kernels/common/dq_semaphore.h, DqSemaphore::turn),
checked on the host against its definition: for query tile m, the key blocks below n_block in
n_block's group whose query range (WindowMask::m_block_range) contains m. A count too high makes a
block wait forever, too low lets two blocks add at once. Compiled with nvcc (host code only);
skipped without it or without the CUTLASS headers."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"

PROGRAM = r"""
#include "kernels/common/dq_semaphore.h"
#include <cstdio>
using namespace cutlass_flash;

template <int kBlockM, int kBlockN>
int reference(const WindowMask& mask, int m_block, int n_block, int groups) {
  int count = 0;
  for (int n = n_block % groups; n < n_block; n += groups) {
    int m_min, m_max;
    mask.m_block_range<kBlockM, kBlockN>(n, m_min, m_max);
    count += m_min <= m_block && m_block < m_max;
  }
  return count;
}

template <int kBlockM, int kBlockN>
void check(int& cases, int& errors) {
  const int lens[] = {1, 17, 64, 100, 128, 129, 1000, 1023, 4097};
  const int windows[][2] = {{-1, -1}, {-1, 0}, {0, 0}, {0, -1}, {5, 3}, {100, -1}, {-1, 50}, {300, 0}, {2000, 2000}};
  for (int sq : lens)
    for (int sk : lens)
      for (const auto& w : windows)
        for (int groups : {1, 4}) {
          const WindowMask mask(sq, sk, w[0], w[1]);
          const int m_blocks = (sq + kBlockM - 1) / kBlockM, n_blocks = (sk + kBlockN - 1) / kBlockN;
          for (int n = 0; n < n_blocks; ++n)
            for (int m = 0; m < m_blocks; ++m) {
              ++cases;
              const int got = DqSemaphore::turn<kBlockM, kBlockN>(mask, m, n, groups);
              const int want = reference<kBlockM, kBlockN>(mask, m, n, groups);
              if (got != want && ++errors <= 5)
                std::printf("sq=%d sk=%d window=(%d,%d) groups=%d m=%d n=%d: %d, want %d\n", sq, sk, w[0], w[1],
                            groups, m, n, got, want);
            }
        }
}

int main() {
  int cases = 0, errors = 0;
  check<64, 64>(cases, errors);
  check<64, 128>(cases, errors);
  check<128, 128>(cases, errors);
  check<128, 64>(cases, errors);
  check<64, 16>(cases, errors);
  std::printf("cases=%d errors=%d\n", cases, errors);
  return errors != 0;
}
"""


def _cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return inc if (inc / "cute").is_dir() else None


def test_turn_counts_the_lower_blocks_of_the_group(tmp_path):
    nvcc, cutlass = shutil.which("nvcc"), _cutlass_include()
    if nvcc is None or cutlass is None:
        pytest.skip("nvcc or the nvidia-cutlass headers not found")
    src = tmp_path / "turn.cu"
    src.write_text(PROGRAM)
    exe = tmp_path / "turn"
    subprocess.run([nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-I", str(CSRC), "-I", str(CSRC / "include"),
                    "-I", str(cutlass), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    cases = int(out.stdout.split("cases=")[1].split()[0])
    assert cases > 100000 and out.stdout.strip().endswith("errors=0"), out.stdout
