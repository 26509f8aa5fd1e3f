#!/usr/bin/env bash
# MLA's (192, 128) on the GPU machine in one call: builds the whole library from this tree, runs
# the (192, 128) GPU tests (both families) and lab/mla.py beside FlashAttention-3's (192, 128)
# build, and returns the library for later calls:
#
#   OUT=$OUT bash lab/device_mla.sh      # carry .carry/s22/cutlass-include.tgz, .carry/fa3mla
#
# .carry/s22/cutlass-include.tgz: CUTLASS's include/ (no nvidia-cutlass wheel needed);
# .carry/fa3mla/fa3built.tgz: FA3 built by lab/device_fa3.sh with FA3_PACK=1 (its header says how).
# Writes $OUT/lib.tgz (the kernel library), build.log, the test logs and mla.md.
# AB_LIB=TGZ: then lab/device_ab_lib.sh (this library against that one).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
mkdir -p /tmp/cutlass && tar xzf .carry/s22/cutlass-include.tgz -C /tmp/cutlass
start=$(date +%s)
if ! CUTLASS_FLASH_CUTLASS_DIR=/tmp/cutlass CUTLASS_FLASH_JOBS=16 python3 setup.py build_ext --inplace \
    >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
grep -E "spill" "$OUT/build.log" | grep -v " 0 bytes spill stores" | sort | uniq -c | head -10
tar czf "$OUT/lib.tgz" cutlass_flash/libcutlass_flash_kernels.so
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
. lab/device_lib.sh
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} 2>&1 | tee "$OUT/env.txt"
shard 0 mla-sm90 0 tests/test_head_dim_v.py
shard 0 mla-sm80 80 tests/test_head_dim_v.py
mkdir -p /tmp/fa3mla && tar xzf .carry/fa3mla/fa3built.tgz -C /tmp/fa3mla
PYTHONPATH=/tmp/fa3mla:$PYTHONPATH python3 lab/mla.py --out "$OUT" ${MLA_ARGS:-} 2>&1 | tail -30
if [ -n "${AB_LIB:-}" ]; then bash lab/device_ab_lib.sh; fi
