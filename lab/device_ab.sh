#!/usr/bin/env bash
# One call on the GPU machine after a kernel change: the low-level pair and compute-sanitizer on
# the changed paths, an A/B of the dense grid against another commit's carried kernel library
# (BASE_LIB or BASE_TREE, below: new, base, new rounds, both families beside SDPA's backends),
# then TESTS.
#
#   BASE_TREE=.carry/basetree TESTS="tests/test_varlen_isolation.py" OUT=$OUT bash lab/device_ab.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/ab_logs
mkdir -p "$OUT" "$LOGS"
CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build.log" 2>&1 || tail -20 "$LOGS/build.log"
lib=cutlass_flash/libcutlass_flash_kernels.so
[ -d /tmp/fa3/hopper ] && FA3_PATH=/tmp/fa3/hopper  # FlashAttention-3 built by device_fa3.sh on this machine
cp "$lib" /tmp/lib_new.so
timeout 120 python3 -m pytest -q -m gpu tests/test_lowlevel.py -p no:cacheprovider 2>&1 | tail -2
for args in "90 64,128,192,256 varlen" "80 64,128 varlen" "90 128,192 det" "90 64,256"; do
  timeout 120 compute-sanitizer --tool memcheck python3 lab/sanitize_small.py $args >"$LOGS/memcheck-${args// /_}.log" 2>&1
  echo "memcheck $args: rc $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck-${args// /_}.log")"
done
# BASE_LIB: a library with the same C API as this checkout's binding; BASE_TREE: another commit's
# package (cutlass_flash/ with its library, setup.py, csrc/ for the binding), run from its folder.
if [ -n "${BASE_TREE:-}" ]; then
  (cd "$BASE_TREE" && CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build_base.log" 2>&1) ||
    tail -20 "$LOGS/build_base.log"
fi
if [ -n "${BASE_LIB:-}${BASE_TREE:-}" ]; then
  root=$PWD
  for round in new base new2; do
    dir=$root
    if [ "$round" = base ] && [ -n "${BASE_TREE:-}" ]; then dir=$root/$BASE_TREE
    elif [ "$round" = base ]; then cp "$BASE_LIB" "$lib"; else cp /tmp/lib_new.so "$lib"; fi
    (cd "$dir" && PYTHONPATH=$dir${FA3_PATH:+:$FA3_PATH} timeout "${DENSE_TIMEOUT:-100}" python3 -m cutlass_flash.benchmark \
      ${DENSE_ARGS:---arch 80,90 --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3} \
      --no-plot --tag "ab-$round" --out "$OUT") >"$LOGS/ab-$round.log" 2>&1
    echo "dense $round: rc $?"
  done
  cp /tmp/lib_new.so "$lib"
fi
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -m gpu $TESTS -p no:cacheprovider >"$LOGS/tests.log" 2>&1
  echo "tests (rc $?):"; tail -8 "$LOGS/tests.log"
fi
tar -C "$LOGS" -czf "$OUT/logs-ab.tar.gz" .
