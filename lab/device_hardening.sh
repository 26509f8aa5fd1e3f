#!/usr/bin/env bash
# Issue 31 (every call a right answer or a clear error) on a 4-GPU machine, in two calls on one warm
# machine (FlashAttention-3's build stays in /tmp/fa3 between them):
#
#   PHASE=tests OUT=$OUT bash lab/device_hardening.sh   # FA3 built in the background; the
#                        # GPU suite in 4 shards, one per GPU (strict), memcheck, the memory probe
#   PHASE=bench OUT=$OUT BASE_TREE=.carry/basetree bash lab/device_hardening.sh
#                        # GPU 0: the dense A/B of both families against the base commit beside
#                        # FA3 / cuDNN / FA2; GPU 1: the deterministic cost, ours and FA3's
#   PHASE=sm80 OUT=$OUT BASE_TREE=.carry/basetree bash lab/device_hardening.sh
#                        # one GPU: the sm80 family on narrow head dims (tests, memcheck, memory,
#                        # A/B against the base beside FA2)
#
# The kernel library is built on a CPU machine (`python setup.py build_ext --inplace`) and
# carried with .carry/fa3src.tar.gz (lab/pack_fa3src.sh) and the base tree.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/hardening_logs
mkdir -p "$OUT" "$LOGS"
[ -d /tmp/fa3/hopper ] && FA3_PATH=/tmp/fa3/hopper
python3 -c "import cutlass_flash._C" 2>/dev/null ||
  CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build.log" 2>&1 || tail -20 "$LOGS/build.log"

shard() {  # shard GPU NAME TESTS...: the GPU tests of TESTS on one GPU, strict
  local gpu=$1 name=$2 start=$(date +%s)
  shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -rs --strict-gpu --maxfail=30 \
    -m gpu "$@" -p no:cacheprovider >"$LOGS/tests-$name.log" 2>&1
  echo "[$name] rc $?, $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/tests-$name.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests-$name.log" | head -20
}

case "${PHASE:-tests}" in
  tests)
    (OUT=$LOGS bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
    {
      nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    } 2>&1 | tee "$OUT/env.txt"
    shard 0 new tests/test_hardening.py tests/test_gpu_misc.py tests/test_transformers.py tests/test_lowlevel.py \
      tests/test_gpu_training.py tests/test_dropout.py >"$LOGS/s0.txt" &
    shard 1 accuracy tests/test_gpu_accuracy.py >"$LOGS/s1.txt" &
    shard 2 isolation tests/test_varlen_isolation.py tests/test_seqused.py >"$LOGS/s2.txt" &
    {
      shard 3 varlen tests/test_varlen.py
      # memcheck on the changed paths: the sm90 kernels on narrow head dims (TMA zero fill, the
      # column-checked stores, the preprocess), dense, packed and deterministic (the closed-form
      # turns); the sm80 family's padded copies.
      for args in "90 80,112,200" "90 80,200 varlen" "90 64,128,256 det" "80 80,128 det"; do
        CUDA_VISIBLE_DEVICES=3 timeout 100 compute-sanitizer --tool memcheck python3 lab/sanitize_small.py $args \
          >"$LOGS/memcheck-${args// /-}.log" 2>&1
        echo "memcheck $args: rc $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck-${args// /-}.log" | tail -1)"
      done
      CUDA_VISIBLE_DEVICES=3 timeout 150 python3 benchmarks/hardening_memory.py --out "$OUT" 2>&1 | tail -16
    } >"$LOGS/s3.txt" &
    wait
    cat "$LOGS"/s[0-3].txt
    tail -3 "$LOGS/fa3.txt"
    ;;
  sm80)
    # One GPU: the sm80 family reading narrow head dims (its column-predicated loads): the tests
    # that force it, memcheck, the memory probe, and its A/B against the base beside FA2.
    CUTLASS_FLASH_FORCE_ARCH=80 timeout 300 python3 -m pytest -q -rs --strict-gpu --maxfail=20 -m gpu \
      tests/test_hardening.py tests/test_lowlevel.py tests/test_gpu_accuracy.py tests/test_varlen.py \
      -p no:cacheprovider >"$LOGS/tests-sm80.log" 2>&1
    echo "sm80-forced GPU tests (rc $?): $(tail -1 "$LOGS/tests-sm80.log")"
    grep -E "^(FAILED|ERROR)" "$LOGS/tests-sm80.log" | head -20
    for args in "80 80,112,200" "80 80,200 varlen" "80 80,200 det"; do
      timeout 100 compute-sanitizer --tool memcheck python3 lab/sanitize_small.py $args \
        >"$LOGS/memcheck-${args// /-}.log" 2>&1
      echo "memcheck $args: rc $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck-${args// /-}.log" | tail -1)"
    done
    timeout 150 python3 benchmarks/hardening_memory.py --out "$OUT" --det-seqlen 32768 2>&1 | tail -14
    (cd "$BASE_TREE" && CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build_base.log" 2>&1)
    root=$PWD
    for round in new base new2; do
      dir=$root
      [ "$round" = base ] && dir=$root/$BASE_TREE
      (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 -m cutlass_flash.benchmark --arch 80 --impls ours,sdpa-flash \
        --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3 --no-plot --tag "sm80-narrow-$round" --out "$OUT") \
        >"$LOGS/sm80-$round.log" 2>&1
      echo "sm80 A/B $round: rc $?"
    done
    ;;
  bench)
    lib=cutlass_flash/libcutlass_flash_kernels.so
    if [ -n "${BASE_TREE:-}" ]; then
      (cd "$BASE_TREE" && CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build_base.log" 2>&1) ||
        tail -20 "$LOGS/build_base.log"
    fi
    root=$PWD
    {
      for round in new ${BASE_TREE:+base}; do
        dir=$root
        [ "$round" = base ] && dir=$root/$BASE_TREE
        (cd "$dir" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$dir${FA3_PATH:+:$FA3_PATH} timeout "${DENSE_TIMEOUT:-200}" \
          python3 -m cutlass_flash.benchmark ${DENSE_ARGS:---arch 80,90 --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3} \
          --no-plot --tag "hardening-$round" --out "$OUT") >"$LOGS/ab-$round.log" 2>&1
        echo "dense $round: rc $?"
      done
    } >"$LOGS/b0.txt" &
    for round in new ${BASE_TREE:+base}; do
      dir=$root
      [ "$round" = base ] && dir=$root/$BASE_TREE
      (cd "$dir" && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$dir${FA3_PATH:+:$FA3_PATH} timeout "${DET_TIMEOUT:-150}" \
        python3 "$root/benchmarks/features.py" --impls ours,ours-det,fa3,fa3-det --modes bwd --head-dims 64,128,256 \
        --seqlens 4096,16384 --rounds 2 --no-plot --tag "det-$round" --out "$OUT") >"$LOGS/det-$round.log" 2>&1
      echo "det $round: rc $?"
    done
    wait
    cat "$LOGS/b0.txt"
    ;;
esac
tar -C "$LOGS" -czf "$OUT/logs-hardening-${PHASE:-tests}.tar.gz" .
