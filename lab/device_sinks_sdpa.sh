#!/usr/bin/env bash
# Attention sinks (issue 33), SDPA's flash implementation and context parallelism (issue 34), on a
# 2-GPU machine, in calls on one warm machine (the library built on the CPU machine and carried;
# ring-flash-attn's wheel in .carry/wheels):
#
#   PHASE=tests OUT=$OUT bash lab/device_sinks_sdpa.sh
#       GPU 0: the default GPU suite (sm90 family: sinks, the SDPA backend, transformers' gpt-oss
#       among it); GPU 1: the sm80 family forced on the accuracy grid, the features, packed
#       batches and sinks. FlashAttention-3 built niced in the background for the bench phase.
#   PHASE=bench OUT=$OUT BASE_TREE=.carry/base96 bash lab/device_sinks_sdpa.sh
#       GPU 0: the sm80 family against BASE_TREE's beside SDPA's FA2 (bf16 grid, two rounds of
#       each), fp16 grid; GPU 1: the sm90 family against BASE_TREE's beside FA3 and cuDNN, then the
#       sinks' cost (lab/sinks_cost.py).
#   PHASE=final OUT=$OUT bash lab/device_sinks_sdpa.sh
#       the sinks and SDPA tests on both families, the sinks' cost per family, then the cp phase.
#   PHASE=cp OUT=$OUT bash lab/device_sinks_sdpa.sh
#       benchmarks/context_parallel.py under torchrun on both GPUs.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/cutlass_flash_out}
LOGS=/tmp/sinks_logs
mkdir -p "$OUT" "$LOGS"
TEST_TIMEOUT=${TEST_TIMEOUT:-500}
. lab/device_lib.sh
binding
python3 -c "import ring_flash_attn" 2>/dev/null || python3 -m pip install --no-deps --no-index .carry/wheels/ring_flash_attn-*.whl \
  >"$LOGS/pip.log" 2>&1 || tail -5 "$LOGS/pip.log"

case "${PHASE:-tests}" in
  tests)
    (OUT=$LOGS nice -n 19 bash lab/device_fa3.sh >"$LOGS/fa3.txt" 2>&1) &
    fa3=$!
    {
      nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
    } 2>&1 | tee "$OUT/env.txt"
    (shard 0 default 0 tests >"$LOGS/s0.txt") &
    p0=$!
    (
      shard 1 sm80-accuracy 80 tests/test_gpu_accuracy.py tests/test_sinks.py
      shard 1 sm80-features 80 tests/test_gpu_misc.py tests/test_dropout.py tests/test_hardening.py \
        tests/test_lowlevel.py tests/test_gpu_training.py tests/test_transformers.py tests/test_sdpa_backend.py
      shard 1 sm80-packed 80 tests/test_varlen.py tests/test_varlen_isolation.py tests/test_seqused.py
    ) >"$LOGS/s1.txt" &
    p1=$!
    wait $p0 $p1
    cat "$LOGS"/s0.txt "$LOGS"/s1.txt
    # FA3 for the bench phase (in /tmp/fa3/hopper): waited for at most FA3_WAIT seconds more.
    for _ in $(seq "${FA3_WAIT:-60}"); do [ -f "$LOGS/fa3_build.done" ] && break; sleep 1; done
    tail -3 "$LOGS/fa3.txt"
    ;;
  bench)
    binding "$BASE_TREE"
    root=$PWD
    [ -f "$LOGS/fa3_build.done" ] && FA3_PATH=/tmp/fa3/hopper
    GRID80=${GRID80:---head-dims 64,128,256 --seqlens 1024,2048,4096,8192,16384 --rounds 3 --budget-ms 40}
    bench() {  # bench GPU TREE TAG ARGS...: cutlass_flash.benchmark from TREE (new: this checkout)
      local g=$(gpu $1) dir=$root tag=$3
      [ "$2" = base ] && dir=$root/$BASE_TREE
      shift 3
      (cd "$dir" && CUDA_VISIBLE_DEVICES=$g PYTHONPATH=$dir${FA3_PATH:+:$FA3_PATH} timeout 280 python3 -m cutlass_flash.benchmark \
        "$@" --no-plot --tag "$tag" --out "$OUT") >"$LOGS/$tag.log" 2>&1
      echo "$tag: rc $?"
    }
    (
      for r in 1 2; do for t in new base; do
        bench 0 $t sm80-bf16-$t-r$r --arch 80 --impls ours,sdpa-flash --dtype bf16 $GRID80
      done; done
      bench 0 new sm80-fp16-new --arch 80 --impls ours,sdpa-flash --dtype fp16 $GRID80
    ) >"$LOGS/b0.txt" 2>&1 &
    (
      for t in new base; do
        bench 1 $t sm90-$t --arch 90 --impls ours,sdpa-cudnn,fa3 --head-dims 64,128,256 --seqlens 2048,8192 --rounds 3
      done
      CUDA_VISIBLE_DEVICES=$(gpu 1) timeout 200 python3 lab/sinks_cost.py --out "$OUT" >"$LOGS/sinks-cost.log" 2>&1
      echo "sinks cost: rc $?"
    ) >"$LOGS/b1.txt" 2>&1 &
    wait
    cat "$LOGS"/b0.txt "$LOGS"/b1.txt
    ;;
  final)  # the mended tests of both families, the sinks' cost per family, then cp
    (shard 0 sm90-sinks-sdpa 0 tests/test_sdpa_backend.py tests/test_sinks.py tests/test_transformers.py >"$LOGS/f0.txt";
     CUDA_VISIBLE_DEVICES=$(gpu 0) timeout 150 python3 lab/sinks_cost.py --archs 90 --out "$OUT/sm90" >"$LOGS/sinks-cost-90.log" 2>&1) &
    p0=$!
    (shard 1 sm80-sinks-sdpa 80 tests/test_sdpa_backend.py tests/test_sinks.py >"$LOGS/f1.txt";
     CUDA_VISIBLE_DEVICES=$(gpu 1) timeout 150 python3 lab/sinks_cost.py --archs 80 --out "$OUT/sm80" >"$LOGS/sinks-cost-80.log" 2>&1) &
    p1=$!
    wait $p0 $p1
    cat "$LOGS"/f0.txt "$LOGS"/f1.txt "$LOGS"/sinks-cost-*.log
    timeout 300 torchrun --nproc-per-node "$NGPU" benchmarks/context_parallel.py --out "$OUT" ${CP_ARGS:-} \
      >"$LOGS/cp.log" 2>&1
    echo "context_parallel: rc $?"
    tail -40 "$LOGS/cp.log"
    ;;
  cp)
    timeout 540 torchrun --nproc-per-node "$NGPU" benchmarks/context_parallel.py --out "$OUT" ${CP_ARGS:-} \
      >"$LOGS/cp.log" 2>&1
    echo "context_parallel: rc $?"
    tail -40 "$LOGS/cp.log"
    ;;
esac
# One tarball (the device tool returns at most 8 files): the tables move into it.
mkdir -p "$LOGS/out" && find "$OUT" -mindepth 1 -type f ! -name env.txt ! -name "*.tar.gz" -exec mv --backup=numbered {} "$LOGS/out/" \;
tar -C "$LOGS" -czf "$OUT/sinks-sdpa-${PHASE:-tests}.tar.gz" .
