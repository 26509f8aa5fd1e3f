#!/usr/bin/env bash
# One call on the GPU machine after a kernel change: the low-level pair and compute-sanitizer on
# the changed paths, an A/B of the dense grid against another commit's carried kernel library
# (BASE_LIB: new, base, new rounds, both families beside SDPA's backends), then TESTS.
#
#   BASE_LIB=.carry/base/libcutlass_flash_kernels.so TESTS="tests/test_varlen_isolation.py" \
#     OUT=$OUT bash benchmarks/device_ab.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/ab_logs
mkdir -p "$OUT" "$LOGS"
CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build.log" 2>&1 || tail -20 "$LOGS/build.log"
lib=cutlass_flash/libcutlass_flash_kernels.so
cp "$lib" /tmp/lib_new.so
timeout 120 python3 -m pytest -q -m gpu tests/test_lowlevel.py -p no:cacheprovider 2>&1 | tail -2
for args in "90 64,128,192,256 varlen" "80 64,128 varlen" "90 128,192 det" "90 64,256"; do
  timeout 120 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_small.py $args >"$LOGS/memcheck-${args// /_}.log" 2>&1
  echo "memcheck $args: rc $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck-${args// /_}.log")"
done
if [ -n "${BASE_LIB:-}" ]; then
  for round in new base new2; do
    if [ "$round" = base ]; then cp "$BASE_LIB" "$lib"; else cp /tmp/lib_new.so "$lib"; fi
    timeout "${DENSE_TIMEOUT:-100}" python3 -m cutlass_flash.benchmark ${DENSE_ARGS:---arch 80,90 --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3} \
      --no-plot --tag "ab-$round" --out "$OUT" >"$LOGS/ab-$round.log" 2>&1
    echo "dense $round: rc $?"
  done
  cp /tmp/lib_new.so "$lib"
fi
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -m gpu $TESTS -p no:cacheprovider >"$LOGS/tests.log" 2>&1
  echo "tests (rc $?):"; tail -8 "$LOGS/tests.log"
fi
tar -C "$LOGS" -czf "$OUT/logs-ab.tar.gz" .
