# Shared by the device_*.sh scripts (sourced): the binding's build, GPU placement and strict test
# shards. The caller sets LOGS (where the logs go) and TEST_TIMEOUT (seconds per shard).

binding() {  # binding [TREE]: the pybind11 module against the tree's carried kernel library
  if [ $# -eq 0 ]; then  # this checkout: only where it has none yet
    python3 -c "import cutlass_flash._C" 2>/dev/null ||
      CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build.log" 2>&1 || tail -20 "$LOGS/build.log"
  else
    (cd "$1" && CUTLASS_FLASH_BINDING_ONLY=1 python3 setup.py build_ext --inplace >"$LOGS/build_base.log" 2>&1) ||
      tail -20 "$LOGS/build_base.log"
  fi
}

# Fewer GPUs than a script's parts: part g runs on GPU g % NGPU.
NGPU=$(nvidia-smi -L | wc -l)
gpu() { echo $(( $1 % NGPU )); }

shard() {  # shard GPU NAME ARCH TESTS...: the GPU tests of TESTS on one GPU, strict, family ARCH (0: auto)
  local g=$(gpu $1) name=$2 arch=$3 start=$(date +%s)
  shift 3
  CUDA_VISIBLE_DEVICES=$g CUTLASS_FLASH_FORCE_ARCH=$arch timeout "$TEST_TIMEOUT" python3 -m pytest -q -rs \
    --strict-gpu --maxfail=30 -m gpu "$@" -p no:cacheprovider >"$LOGS/tests-$name.log" 2>&1
  echo "[$name] rc $?, $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/tests-$name.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests-$name.log" | head -20
}
