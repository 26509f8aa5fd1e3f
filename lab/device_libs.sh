#!/usr/bin/env bash
# Kernel libraries built elsewhere (here, or by an earlier call), timed side by side on the GPU
# machine in one call: one copy of this tree per library, the binding built once, then RUN in
# each copy, in rounds (A B A B: clock drift shows between rounds, not between libraries).
#
#   LIBS="base=.carry/s24/lib-head.tgz var=.carry/s25/lib-var.tgz" \
#   RUN='python3 lab/mla.py --seqlens 2048,8192 --out $DIR' \
#   TESTS_LIB=var TESTS="tests/test_gpu_accuracy.py tests/test_head_dim_v.py" \
#   FA3_TGZ=.carry/fa3mla/fa3built.tgz OUT=$OUT bash lab/device_libs.sh
#
# LIBS: NAME=TGZ pairs (a tarball of cutlass_flash/libcutlass_flash_kernels.so, e.g.
# lab/device_mla.sh's lib.tgz, or one built here with restricted knobs). RUN: a command run in each
# copy with NAME, ROUND and DIR ($OUT/NAME-rROUND) set; ROUNDS (default 2). TESTS_LIB / TESTS: GPU
# tests of one library first (not strict: a restricted library skips what it lacks). AFTER: a
# command run once after the rounds, in AFTER_LIB's copy (default the first). Everything under $OUT returns
# as one tarball (the device tool returns 8 files).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
RES=/tmp/libs_out
mkdir -p "$RES"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$RES/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$RES/env.txt"
first_tgz=${LIBS%% *}; first_tgz=${first_tgz#*=}
tar xzf "$first_tgz" || exit 1  # the binding links against a library in the tree
CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$RES/binding.log" 2>&1 || tail -20 "$RES/binding.log"
if [ -n "${FA3_TGZ:-}" ]; then
  mkdir -p /tmp/fa3lib && tar xzf "$FA3_TGZ" -C /tmp/fa3lib && export PYTHONPATH=/tmp/fa3lib${PYTHONPATH:+:$PYTHONPATH}
fi
first=""
for pair in $LIBS; do
  name=${pair%%=*} tgz=${pair#*=}
  [ -n "$first" ] || first=$name
  rm -rf "/tmp/lib_$name" && mkdir -p "/tmp/lib_$name"
  tar -C "$PWD" --exclude=./.carry --exclude=./build -cf - . | tar -C "/tmp/lib_$name" -xf -
  tar xzf "$tgz" -C "/tmp/lib_$name" || exit 1
done
if [ -n "${TESTS:-}" ]; then
  start=$(date +%s)
  (cd "/tmp/lib_$TESTS_LIB" && PYTHONPATH=$PWD:${PYTHONPATH:-} timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu \
    -n 8 -p no:cacheprovider $TESTS >"$RES/tests-$TESTS_LIB.log" 2>&1)
  echo "tests $TESTS_LIB: rc $?, $(( $(date +%s) - start )) s: $(tail -1 "$RES/tests-$TESTS_LIB.log")"
  grep -E "^(FAILED|ERROR)" "$RES/tests-$TESTS_LIB.log" | head -20
fi
for ROUND in $(seq 1 "${ROUNDS:-2}"); do
  for pair in $LIBS; do
    NAME=${pair%%=*} DIR=$RES/$NAME-r$ROUND
    mkdir -p "$DIR"
    start=$(date +%s)
    (cd "/tmp/lib_$NAME" && export NAME ROUND DIR PYTHONPATH=/tmp/lib_$NAME:${PYTHONPATH:-} && eval "$RUN") \
      >"$DIR/run.log" 2>&1
    echo "== $NAME round $ROUND: rc $?, $(( $(date +%s) - start )) s"
    grep -E "^\| " "$DIR/run.log" | grep -vE "^\| (mode|---)" | head -40
  done
done
if [ -n "${AFTER:-}" ]; then
  al=${AFTER_LIB:-$first}
  (cd "/tmp/lib_$al" && export DIR=$RES/after && mkdir -p "$DIR" && PYTHONPATH=/tmp/lib_$al:${PYTHONPATH:-} eval "$AFTER") \
    >"$RES/after.log" 2>&1
  echo "== after: rc $?"
  grep -E "^\| " "$RES/after.log" | head -60
fi
tar -C /tmp -czf "$OUT/libs_out.tgz" libs_out
