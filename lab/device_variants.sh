#!/usr/bin/env bash
# A/B of kernel variants in one call on the GPU machine: each variant is this checkout with one
# patch of lab/variants/ applied; all are built side by side (restricted knobs, in
# parallel), then each runs the GPU tests and the benchmark, in turn, twice (the order ABC ABC, so
# clock drift shows as a difference between rounds, not between variants).
#
#   OUT=$OUT VARIANTS="base dv-early downward-walk" bash lab/device_variants.sh
#
# "base" is the checkout as it is; NAME is lab/variants/NAME.patch; A+B applies both. Knobs: DIMS (head dims, default 64,128), DTYPES (bf16),
# ARCHS (90), TESTS (pytest arguments, default: every GPU test of the restricted build), BENCH
# (extra benchmark arguments, default: backward, 2k and 8k tokens, causal and not, against
# cuDNN), PHASES (default "build run": a call of 600 s holds about 3 builds, or 3 variants' tests
# and timings, so "build" and "run" can go in two calls on the same warm machine). Returns one
# CSV per variant (bench_NAME.csv, both rounds, a `round` column) and the logs of failed builds. Needs CUTLASS's headers: the nvidia-cutlass wheel under .carry/ (see lab/device_build.sh) or CUTLASS_TGZ.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
DIMS=${DIMS:-64,128} DTYPES=${DTYPES:-bf16} ARCHS=${ARCHS:-90}
TESTS=${TESTS:--m gpu}
BENCH=${BENCH:---modes bwd --seqlens 2048,8192 --impls ours,sdpa-cudnn --rounds 3 --budget-ms 100}
mkdir -p "$OUT"
# CUTLASS's headers: the nvidia-cutlass wheel under .carry/, or CUTLASS's include/ as a tarball
# (CUTLASS_TGZ, default .carry/s22/cutlass-include.tgz, as lab/device_mla.sh takes it).
if ls .carry/nvidia_cutlass-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/nvidia_cutlass-*.whl || exit 1
else
  mkdir -p /tmp/cutlass && tar xzf "${CUTLASS_TGZ:-.carry/s22/cutlass-include.tgz}" -C /tmp/cutlass || exit 1
  export CUTLASS_FLASH_CUTLASS_DIR=/tmp/cutlass
fi
export PYTHONPATH=/tmp/site
# FlashAttention-3, where lab/device_fa3.sh built it earlier on this machine (an fa3 column).
if [ -d /tmp/fa3/hopper ]; then export PYTHONPATH=/tmp/fa3/hopper:$PYTHONPATH; fi
PHASES=${PHASES:-build run}
root=$(pwd)
# Output names use _ for + (the device tool returns no file whose name has a +).
if [[ " $PHASES " == *" build "* ]]; then
for v in $VARIANTS; do
  rm -rf "/tmp/v$v" && mkdir -p "/tmp/v$v"
  tar -C "$root" --exclude=./build --exclude=./.carry -cf - . | tar -C "/tmp/v$v" -xf -
  if [ "$v" != base ]; then
    for part in ${v//+/ }; do (cd "/tmp/v$v" && patch -s -p1 < "$root/lab/variants/$part.patch") || exit 1; done
  fi
  # The build log comes back only when the build fails (the device tool returns 8 files a call).
  (cd "/tmp/v$v" && CUTLASS_FLASH_ARCHS=$ARCHS CUTLASS_FLASH_HEAD_DIMS=$DIMS CUTLASS_FLASH_DTYPES=$DTYPES \
     CUTLASS_FLASH_JOBS=8 python3 setup.py build_ext --inplace >"/tmp/build_${v//+/_}.log" 2>&1
   rc=$?; echo "build $v: rc=$rc"; grep -E "nvcc .*spill" "/tmp/build_${v//+/_}.log" | grep -v " 0 B spill"
   if [ $rc != 0 ]; then cp "/tmp/build_${v//+/_}.log" "$OUT/"; fi) &
done
wait
fi
[[ " $PHASES " == *" run "* ]] || exit 0
for v in $VARIANTS; do
  echo "== tests $v"
  (cd "/tmp/v$v" && eval "timeout 300 python3 -m pytest -q -n 6 -rf tests $TESTS" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-200)
done
# One CSV per variant, both rounds in it (a `round` column first): 8 variants fit the device
# tool's 8 returned files, where a CSV and a markdown per round had 4 rounds of 2 variants.
for r in 1 2; do
  for v in $VARIANTS; do
    echo "== benchmark $v, round $r"
    rm -rf "/tmp/bench_${v//+/_}_$r"
    (cd "/tmp/v$v" && timeout 200 python3 -m cutlass_flash.benchmark --head-dims "$DIMS" --dtype "$DTYPES" $BENCH \
       --no-plot --out "/tmp/bench_${v//+/_}_$r" 2>&1 | grep "^| [0-9]")
    for csv in /tmp/bench_${v//+/_}_$r/*.csv; do
      [ -f "$csv" ] || continue  # a run that wrote nothing (timed out)
      awk -v r=$r -v first=$([ -f "$OUT/bench_${v//+/_}.csv" ] && echo 0 || echo 1) \
        'NR == 1 { if (first) print "round," $0; next } { print r "," $0 }' "$csv" >>"$OUT/bench_${v//+/_}.csv"
    done
  done
done
