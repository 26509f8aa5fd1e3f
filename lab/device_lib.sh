# Shared by the device_*.sh scripts (sourced): GPU placement and strict test shards. The caller
# sets LOGS (where each shard's log goes) and TEST_TIMEOUT (seconds per shard).

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
