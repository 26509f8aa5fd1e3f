#!/usr/bin/env bash
# The sm80 family on one GPU, forced, beside SDPA's FlashAttention-2 in every process:
#
#   PHASE=ab BASE_TREE=.carry/base OUT=$OUT bash lab/device_sm80_ab.sh
#       this library against BASE_TREE's (a package of the base commit with its library), rounds
#       alternating new, base, new, base (AB_ARGS: the benchmark's grid, default the forward at
#       d = 64 / 128 / 256, 1k / 2k / 8k, causal and not); then the sm80 GPU tests (TESTS)
#   PHASE=grid OUT=$OUT bash lab/device_sm80_ab.sh
#       issue 32's grid: bf16 and fp16, forward, backward and both, d = 64 / 128 / 256, 1k-16k;
#       then the sm80 GPU tests of TESTS where given
#
# Tables and logs go to $OUT as one tarball (the device tool returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/o}
LOGS=$OUT/sm80
TEST_TIMEOUT=${TEST_TIMEOUT:-400}
mkdir -p "$LOGS"
. lab/device_lib.sh
binding
root=$PWD
bench() {  # bench DIR TAG ARGS...: the sm80 family against FA2 from the package in DIR
  local dir=$1 tag=$2
  shift 2
  (cd "$dir" && PYTHONPATH=$dir timeout 280 python3 -m cutlass_flash.benchmark --arch 80 --impls ours,sdpa-flash \
    "$@" --no-plot --tag "$tag" --out "$LOGS") >"$LOGS/$tag.log" 2>&1
  echo "$tag: rc $?"
}
case "${PHASE:-ab}" in
  ab)
    binding "$BASE_TREE"
    # shellcheck disable=SC2086
    for r in 1 2; do
      bench "$root" "sm80-ab-new-r$r" ${AB_ARGS:---modes fwd --head-dims 64,128,256 --seqlens 1024,2048,8192 --rounds 5}
      bench "$root/$BASE_TREE" "sm80-ab-base-r$r" ${AB_ARGS:---modes fwd --head-dims 64,128,256 --seqlens 1024,2048,8192 --rounds 5}
    done
    shard 0 sm80-tests 80 ${TESTS:-tests/test_gpu_accuracy.py tests/test_head_dim_v.py tests/test_sinks.py}
    ;;
  grid)
    for dt in ${DTYPES:-bf16 fp16}; do
      bench "$root" "sm80-grid-$dt" --dtype "$dt" --head-dims 64,128,256 --seqlens 1024,2048,4096,8192,16384 --rounds 5 \
        --budget-ms 40
    done
    # shellcheck disable=SC2086
    [ -n "${TESTS:-}" ] && shard 0 sm80-tests 80 $TESTS
    ;;
esac
tar -C "$OUT" -czf "$OUT/sm80.tgz" sm80 && rm -rf "$LOGS"
