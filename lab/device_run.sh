#!/usr/bin/env bash
# One call on the GPU machine: build the pybind11 module for its Python against the carried kernel
# library, run the GPU tests, run the benchmark; logs and tables go to $OUT.
#
#   OUT=/tmp/out PYTEST_ARGS="-k fwd" BENCH_ARGS="--head-dims 128" bash lab/device_run.sh
#
# The kernel library (cutlass_flash/libcutlass_flash_kernels.so) is built on a CPU machine with
# `python setup.py build_ext --inplace` and carried; see README.md.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} 2>&1 | tee "$OUT/env.txt"
if ! CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi
python3 -c "import cutlass_flash._C as C; print(len(C.built_kernels()), 'kernels built')"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs --maxfail=20 tests ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/tests.log" | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -m cutlass_flash.benchmark ${BENCH_ARGS:-} --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log" | tail -80
fi
