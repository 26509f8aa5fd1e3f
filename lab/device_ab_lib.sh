#!/usr/bin/env bash
# This tree's kernel library against another one, on the GPU machine: the benchmark's AB_ARGS
# (default: the d = 192 backward, 2k / 8k, causal and not, ours only) from this tree and from a
# copy of it with AB_LIB's library, rounds new, base, new, base; tables and logs to $OUT/ab.tgz.
#
#   AB_LIB=.carry/base-lib.tgz AB_ARGS="--arch 80,90 --modes bwd ..." OUT=$OUT bash lab/device_ab_lib.sh
#
# AB_LIB: a tarball of cutlass_flash/libcutlass_flash_kernels.so (lab/device_mla.sh's lib.tgz) of a
# commit with the same C API as this tree's binding (built here, or already, for this tree).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
python3 -c "import cutlass_flash._C" 2>/dev/null ||
  CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >/tmp/ab_binding.log 2>&1 || tail -20 /tmp/ab_binding.log
rm -rf /tmp/abbase && cp -r "$PWD" /tmp/abbase && tar xzf "$AB_LIB" -C /tmp/abbase
mkdir -p "$OUT/ab"
for r in 1 2; do
  for side in new base; do
    dir=$PWD; [ $side = base ] && dir=/tmp/abbase
    # shellcheck disable=SC2086
    (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 -m cutlass_flash.benchmark --impls ours --no-plot \
      ${AB_ARGS:---modes bwd --head-dims 192 --seqlens 2048,8192 --rounds 5} --tag "ab-$side-r$r" --out "$OUT/ab") \
      >"$OUT/ab/ab-$side-r$r.log" 2>&1
    echo "ab $side r$r: rc $?"
  done
done
tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -rf "$OUT/ab"
