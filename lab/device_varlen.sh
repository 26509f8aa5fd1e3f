#!/usr/bin/env bash
# Packed-batch work on the GPU machine, in two calls on one warm machine (FlashAttention-3's build
# stays in /tmp/fa3 between them):
#
#   PHASE=tests OUT=$OUT bash lab/device_varlen.sh   # FA3 with its varlen path built in the
#                                                           # background while the GPU tests and
#                                                           # compute-sanitizer on packed batches run
#   PHASE=bench OUT=$OUT bash lab/device_varlen.sh   # varlen_bench's mixes beside FA3's
#                                                           # varlen function, then the dense grid of
#                                                           # both families against their anchors
#
# The kernel library is built on a CPU machine (`python setup.py build_ext --inplace`) and carried
# with .carry/fa3src.tar.gz (lab/pack_fa3src.sh).
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the scripts under benchmarks/ import the package
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/varlen_logs
mkdir -p "$OUT" "$LOGS"

case "${PHASE:-tests}" in
  tests)
    # FA3's varlen function: bf16 only, every head dim the mixes use.
    (FLASH_ATTENTION_DISABLE_VARLEN=FALSE FLASH_ATTENTION_DISABLE_FP16=TRUE OUT=$LOGS \
      bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
    fa3=$!
    start=$(date +%s)
    # The packed-batch tests first (their own log), then the rest of the GPU suite.
    packed="tests/test_varlen_isolation.py tests/test_seqused.py tests/test_varlen.py tests/test_lowlevel.py"
    OUT=$LOGS SKIP_BENCH=1 TEST_TIMEOUT=${PACKED_TIMEOUT:-330} PYTEST_ARGS="-m gpu $packed ${PYTEST_EXTRA:-}" \
      bash lab/device_run.sh
    cp "$LOGS/tests.log" "$LOGS/tests_packed.log"
    echo "packed-batch GPU tests: $(( $(date +%s) - start )) s"
    start=$(date +%s)
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rs --maxfail=20 -m gpu tests \
      $(for f in $packed; do echo "--ignore=$f"; done) ${PYTEST_EXTRA:-} >"$LOGS/tests_rest.log" 2>&1
    echo "other GPU tests (rc $?): $(( $(date +%s) - start )) s"
    tail -15 "$LOGS/tests_rest.log"
    for args in "90 64,128,192,256 varlen" "80 64,128 varlen" "90 128,192 det"; do
      timeout 120 compute-sanitizer --tool memcheck python3 lab/sanitize_small.py $args \
        >"$LOGS/memcheck-${args// /-}.log" 2>&1
      echo "memcheck $args: rc $? $(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$LOGS/memcheck-${args// /-}.log") error lines"
      tail -1 "$LOGS/memcheck-${args// /-}.log"
    done
    wait $fa3
    tail -4 "$LOGS/fa3.txt"
    ;;
  bench)
    [ -d /tmp/fa3/hopper ] && export PYTHONPATH=/tmp/fa3/hopper${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import cutlass_flash._C" 2>/dev/null ||
      CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build.log" 2>&1
    timeout "${VARLEN_TIMEOUT:-330}" python3 benchmarks/varlen_bench.py --mix ${MIXES:-all} \
      --head-dims ${HEAD_DIMS:-64,128,256} --out "$OUT" ${VARLEN_ARGS:-} 2>&1 | tee "$LOGS/varlen.log" | tail -60
    # The dense grid of both families against their anchors (FA3 / cuDNN, FA2), and with BASE_LIB
    # (another commit's kernel library) an A/B: new, base, new, each its own process.
    if [ -n "${DENSE_ARGS:-}" ]; then
      lib=cutlass_flash/libcutlass_flash_kernels.so
      cp "$lib" /tmp/lib_new.so
      for round in new ${BASE_LIB:+base new2}; do
        if [ "$round" = base ]; then cp "$BASE_LIB" "$lib"; else cp /tmp/lib_new.so "$lib"; fi
        timeout "${DENSE_TIMEOUT:-150}" python3 -m cutlass_flash.benchmark $DENSE_ARGS --no-plot --tag "dense-$round" \
          --out "$OUT" >"$LOGS/dense-$round.log" 2>&1
        echo "dense $round: rc $?"
      done
      cp /tmp/lib_new.so "$lib"
    fi
    ;;
esac
tar -C "$LOGS" -czf "$OUT/logs-varlen-${PHASE:-tests}.tar.gz" .
