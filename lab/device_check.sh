#!/usr/bin/env bash
# The GPU test suites of both families on one GPU, in one call (the kernel library carried or
# built before; the binding is built here for the machine's Python):
#
#   OUT=$OUT bash lab/device_check.sh
#
# In parallel: the default suite (the family the dispatch picks: sm90 on Hopper), and the sm80
# family forced on the accuracy grid, the features, packed batches, sinks and MLA head dims.
# TEST_TIMEOUT (default 540 s) bounds each shard.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
TEST_TIMEOUT=${TEST_TIMEOUT:-540}
. lab/device_lib.sh
binding
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} 2>&1 | tee "$OUT/env.txt"
(shard 0 default 0 ${DEFAULT_TESTS:-tests} >"$LOGS/s0.txt") &
p0=$!
(
  shard 0 sm80-accuracy 80 tests/test_gpu_accuracy.py tests/test_sinks.py tests/test_head_dim_v.py
  shard 0 sm80-features 80 tests/test_gpu_misc.py tests/test_dropout.py tests/test_hardening.py \
    tests/test_lowlevel.py tests/test_gpu_training.py tests/test_sdpa_backend.py
  shard 0 sm80-packed 80 tests/test_varlen.py tests/test_varlen_isolation.py tests/test_seqused.py
) >"$LOGS/s1.txt" 2>&1 &
p1=$!
wait $p0 $p1
cat "$LOGS"/s0.txt "$LOGS"/s1.txt
