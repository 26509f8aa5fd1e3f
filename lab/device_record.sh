#!/usr/bin/env bash
# A record run on the GPU machine in two phases, each under the device tool's 10 minutes a call,
# on one warm machine (FlashAttention-3's build stays in /tmp/fa3 between them):
#
#   PHASE=tests OUT=$OUT bash lab/device_record.sh   # FA3 built in the background while
#                                                           # the GPU tests run: the default set,
#                                                           # then the full grid's accuracy cases
#   PHASE=bench OUT=$OUT bash lab/device_record.sh   # the benchmark with FA3's column
#   PHASE=bench BASE_LIB=.carry/base/libcutlass_flash_kernels.so ...  # and an A/B against BASE_LIB
#
# The kernel library is built here beforehand (`python setup.py build_ext --inplace`) and carried
# (cutlass_flash/libcutlass_flash_kernels.so); only the pybind11 module is built on the machine
# (lab/device_run.sh). Logs other than the tables go into one tarball, so that the tables
# fit the device tool's 8 returned files.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/record_logs
mkdir -p "$OUT" "$LOGS"
# The record grid (RECORD: benchmark arguments but the dtype), timed for bf16 and fp16: both
# kernel families as columns (sm90 against FA3 / cuDNN, sm80 against FA2), every head dim, so that
# a regression of either family against its anchor shows in the run a change is measured with.
RECORD=${RECORD:---arch 90,80 --head-dims 64,96,128,192,256 --seqlens 1024,2048,8192 --rounds 3 --budget-ms 45}

case "${PHASE:-tests}" in
  tests)
    (OUT=$LOGS bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
    fa3=$!
    start=$(date +%s)
    OUT=$LOGS SKIP_BENCH=1 TEST_TIMEOUT=${TEST_TIMEOUT:-240} PYTEST_ARGS="-m gpu" bash lab/device_run.sh
    echo "default GPU tests: $(( $(date +%s) - start )) s"
    # The full grid's accuracy cases per family, the sm90 one first (FULL_TIMEOUT seconds each).
    for family in sm90 sm80; do
      start=$(date +%s)
      timeout "${FULL_TIMEOUT:-150}" python3 -m pytest -q -m gpu --full -k "test_full_grid and $family" --maxfail=20 \
        tests >"$LOGS/tests_full_$family.log" 2>&1
      echo "full grid, $family (rc $?): $(( $(date +%s) - start )) s"
      tail -3 "$LOGS/tests_full_$family.log"
    done
    wait $fa3
    tail -8 "$LOGS/fa3.txt"
    ;;
  bench)
    [ -d /tmp/fa3/hopper ] && export PYTHONPATH=/tmp/fa3/hopper${PYTHONPATH:+:$PYTHONPATH}
    bench() {  # bench NAME OUT_DIR ARGS...: one benchmark process, its log in the tarball
      local name=$1 dir=$2
      shift 2
      timeout "${BENCH_TIMEOUT:-480}" python3 -m cutlass_flash.benchmark "$@" --out "$dir" --tag "$name" \
        >"$LOGS/bench-$name.log" 2>&1
      echo "bench $name: rc $?"
      grep -A4 "^## " "$dir"/bench-*"$name".md | head -40
    }
    lib=cutlass_flash/libcutlass_flash_kernels.so
    if [ -n "${BASE_LIB:-}" ]; then
      # A/B against another kernel library (BASE_LIB), as A B A rounds of our column beside cuDNN's
      # (a drift anchor), bf16; the record tables come from the first A round.
      cp "$lib" /tmp/lib_a.so
      AB=${AB:---dtype bf16 $RECORD --impls ours,sdpa-cudnn --no-plot}
      bench record-bf16 "$OUT" --dtype bf16 $RECORD
      cp "$BASE_LIB" "$lib" && bench ab-base "$LOGS" $AB
      cp /tmp/lib_a.so "$lib" && bench ab-a2 "$LOGS" $AB
      bench record-fp16 "$OUT" --dtype fp16 $RECORD
    else
      bench record "$OUT" --dtype bf16,fp16 $RECORD
    fi
    ;;
esac
tar -C "$LOGS" -czf "$OUT/logs-${PHASE:-tests}.tar.gz" .
