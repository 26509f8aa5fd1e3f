#!/usr/bin/env bash
# Issue 32 (the sm80 family back to FlashAttention-2's speed; one score policy for both families)
# and issue 31's row 12 on the sm80 family, on a 4-GPU machine in two calls on one warm machine
# (FlashAttention-3's build stays in /tmp/fa3 between them):
#
#   PHASE=tests OUT=$OUT bash lab/device_ampere.sh
#       FA3 built in the background; strict GPU tests in 4 shards, one per GPU: the default suite
#       (sm90 family on this GPU), and the sm80 family forced on the accuracy grid, the features,
#       the hardening rows and packed batches; memcheck of the sm80 narrow-head-dim kernels
#   PHASE=bench OUT=$OUT BASE_TREE=.carry/prevtree [VAR_LIB=lib.so] bash lab/device_ampere.sh
#       GPU 0 / 1: the sm80 family against SDPA's FlashAttention-2, bf16 / fp16, forward, backward
#       and both, d = 64 / 128 / 256, 1k-16k, causal and not (then the same with VAR_LIB); GPU 2: the sm80 A/B against
#       BASE_TREE's library beside FA2, then ncu's warp stall reasons of the plain d = 64 forward
#       with both libraries (NCU=1); GPU 3: the sm90 A/B against BASE_TREE beside FA3 and
#       cuDNN. VAR_GRID80 / VAR_DTYPES: the VAR_LIB grid's arguments and dtypes where they differ.
#
# The kernel library is built on a CPU machine (`python setup.py build_ext --inplace`) and
# carried with .carry/fa3src.tar.gz (lab/pack_fa3src.sh) and the base tree (a package of
# the base commit with its library).
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/ampere_logs
mkdir -p "$OUT" "$LOGS"
[ -d /tmp/fa3/hopper ] && FA3_PATH=/tmp/fa3/hopper
# Fewer than 4 GPUs (a 2-GPU machine): GPU g's work goes to GPU g % NGPU, two processes per GPU.
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
. lab/device_lib.sh
binding

case "${PHASE:-tests}" in
  tests)
    (OUT=$LOGS bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
    {
      nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    } 2>&1 | tee "$OUT/env.txt"
    # DEFAULT_SUITE=0: the sm80 shards only (a change that touched no sm90 object)
    s0() { [ "${DEFAULT_SUITE:-1}" = 1 ] && shard 0 default 0 tests; }
    s1() { shard 1 sm80-accuracy 80 tests/test_gpu_accuracy.py; }
    s2() {
      shard 2 sm80-features 80 tests/test_gpu_misc.py tests/test_dropout.py tests/test_hardening.py tests/test_lowlevel.py \
        tests/test_gpu_training.py tests/test_transformers.py
    }
    s3() {
      shard 3 sm80-packed 80 tests/test_varlen.py tests/test_varlen_isolation.py tests/test_seqused.py
      # memcheck: the sm80 kernels of narrow head dims (column-predicated loads and stores), dense,
      # packed and deterministic, and the plain ones.
      for args in "80 80,112,200" "80 80,200 varlen" "80 80,200 det" "80 64,128,256"; do
        CUDA_VISIBLE_DEVICES=$(gpu 3) timeout 100 compute-sanitizer --tool memcheck python3 lab/sanitize_small.py $args \
          >"$LOGS/memcheck-${args// /-}.log" 2>&1
        echo "memcheck $args: rc $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck-${args// /-}.log" | tail -1)"
      done
      CUDA_VISIBLE_DEVICES=$(gpu 3) timeout 100 python3 -m pytest -q -m gpu -k "row12 and memory" tests/test_hardening.py \
        -p no:cacheprovider 2>&1 | tail -2
      CUDA_VISIBLE_DEVICES=$(gpu 3) timeout 150 python3 benchmarks/hardening_memory.py --det-seqlen 32768 \
        --out "$OUT" 2>&1 | tail -16
    }
    # SHARDS: which of them (default all). One GPU: the shards one after the other (side by side,
    # two subprocess tests ran out of memory on an 80 GB H100).
    for i in ${SHARDS:-0 1 2 3}; do
      if [ "$NGPU" = 1 ]; then "s$i" >"$LOGS/s$i.txt"; else "s$i" >"$LOGS/s$i.txt" & fi
    done
    wait
    cat "$LOGS"/s[0-3].txt
    tail -3 "$LOGS/fa3.txt"
    ;;
  bench)
    if [ -n "${BASE_TREE:-}" ]; then
      binding "$BASE_TREE"
    fi
    root=$PWD
    # VAR_LIB: another kernel library of this tree (a tile variant), timed after this one on the
    # same GPUs, from a copy of the package with that library.
    if [ -n "${VAR_LIB:-}" ]; then
      rm -rf /tmp/vartree && mkdir -p /tmp/vartree && cp -r cutlass_flash /tmp/vartree/ &&
        cp "$VAR_LIB" /tmp/vartree/cutlass_flash/libcutlass_flash_kernels.so
    fi
    # FA3 for the sm90 A/B, built niced beside the sm80 runs where an earlier call left none.
    fa3=""
    if [ -z "${FA3_PATH:-}" ] && [ -f .carry/fa3src.tar.gz ]; then
      (OUT=$LOGS nice -n 19 bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
      fa3=$!
    fi
    GRID80=${GRID80:---head-dims 64,128,256 --seqlens 1024,2048,4096,8192,16384 --rounds 3 --budget-ms 40}
    sm80_grid() {  # sm80_grid GPU DTYPE: the family against FA2 on the grid, then with VAR_LIB
      local g=$1 dt=$2 tree dir
      for tree in ${TREES:-new ${VAR_LIB:+var}}; do
        dir=$root grid=$GRID80
        [ "$tree" = var ] && dir=/tmp/vartree grid=${VAR_GRID80:-$GRID80}
        [ "$tree" = var ] && [[ " ${VAR_DTYPES:-bf16 fp16} " != *" $dt "* ]] && continue
        (cd "$dir" && CUDA_VISIBLE_DEVICES=$(gpu $g) PYTHONPATH=$dir timeout "${SM80_TIMEOUT:-280}" python3 -m cutlass_flash.benchmark \
          --arch 80 --impls ours,sdpa-flash --dtype $dt $grid --no-plot --tag "sm80-$dt-$tree" --out "$OUT" \
          >"$LOGS/sm80-$dt-$tree.log" 2>&1)
        echo "sm80 $dt $tree: rc $?"
      done
    }
    sm80_ab() {  # this library against BASE_TREE's beside FA2, then ncu of the plain d = 64 forward
      local round dir
      for round in new base; do
        dir=$root
        [ "$round" = base ] && dir=$root/$BASE_TREE
        (cd "$dir" && CUDA_VISIBLE_DEVICES=$(gpu 2) PYTHONPATH=$dir timeout 200 python3 -m cutlass_flash.benchmark --arch 80 \
          --impls ours,sdpa-flash --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3 --no-plot \
          --tag "sm80-ab-$round" --out "$OUT") >"$LOGS/sm80-ab-$round.log" 2>&1
        echo "sm80 A/B $round: rc $?"
      done
      # The calls with a feature (the all-features kernels, the policy's switches), forced sm80.
      for round in ${FEATURES_AB:+new base}; do
        dir=$root
        [ "$round" = base ] && dir=$root/$BASE_TREE
        (cd "$dir" && CUDA_VISIBLE_DEVICES=$(gpu 2) PYTHONPATH=$dir CUTLASS_FLASH_FORCE_ARCH=80 timeout 200 \
          python3 "$root/benchmarks/features.py" --impls ours-softcap,ours-alibi,ours-dropout,sdpa-flash --modes fwd,bwd \
          --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3 --no-plot --tag "sm80-features-$round" --out "$OUT") \
          >"$LOGS/sm80-features-$round.log" 2>&1
        echo "sm80 features A/B $round: rc $?"
      done
      for round in ${NCU:+new base}; do
        dir=$root
        [ "$round" = base ] && dir=$root/$BASE_TREE
        (cd "$dir" && CUDA_VISIBLE_DEVICES=$(gpu 2) PYTHONPATH=$dir CUTLASS_FLASH_FORCE_ARCH=80 timeout 120 \
          ncu --kernel-name regex:fwd_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
          --section WarpStateStats --section LaunchStats --section Occupancy \
          python3 "$root/lab/profile_attn.py" fwd 64 8192 0) >"$LOGS/ncu-sm80-fwd64-$round.txt" 2>&1
        echo "ncu $round: rc $?"
      done
    }
    sm90_ab() {  # the sm90 family against BASE_TREE's beside FA3 and cuDNN
      local round dir
      # (a subshell: the build is not its child to wait for; it writes fa3_build.done when done)
      while [ -n "$fa3" ] && [ ! -f "$LOGS/fa3_build.done" ]; do sleep 5; done
      [ -d /tmp/fa3/hopper ] && FA3_PATH=/tmp/fa3/hopper
      for round in new base; do
        dir=$root
        [ "$round" = base ] && dir=$root/$BASE_TREE
        (cd "$dir" && CUDA_VISIBLE_DEVICES=$(gpu 3) PYTHONPATH=$dir${FA3_PATH:+:$FA3_PATH} timeout 220 python3 -m cutlass_flash.benchmark \
          --arch 90 --impls ours,sdpa-cudnn,fa3 --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3 --no-plot \
          --tag "sm90-ab-$round" --out "$OUT") >"$LOGS/sm90-ab-$round.log" 2>&1
        echo "sm90 A/B $round: rc $?"
      done
    }
    # PARTS: which of them (default all); on 2 GPUs those of GPU g and g + 2 in turn, on one GPU
    # all of them in turn.
    part() {
      case $1 in
        0) sm80_grid 0 bf16 ;;
        1) sm80_grid 1 fp16 ;;
        2) sm80_ab ;;
        3) sm90_ab ;;
      esac >"$LOGS/b$1.txt" 2>&1
    }
    PARTS=${PARTS:-0 1 2 3}
    if [ "$NGPU" -ge 4 ]; then
      for i in $PARTS; do part $i & done
    elif [ "$NGPU" = 1 ]; then  # one after the other: timings never share the GPU
      for i in $PARTS; do part $i; done
    else
      for g in 0 1; do
        (for i in $PARTS; do [ $(( i % 2 )) = $g ] && part $i; done) &
      done
    fi
    wait
    cat "$LOGS"/b[0-3].txt 2>/dev/null
    ;;
esac
# Everything in one tarball (the device tool returns 8 files): tables and logs.
mkdir -p "$LOGS/out" && find "$OUT" -maxdepth 2 -type f ! -name env.txt -exec mv {} "$LOGS/out/" \;
tar -C "$LOGS" -czf "$OUT/ampere-${PHASE:-tests}.tar.gz" .
