#!/usr/bin/env bash
# Builds the whole package on the GPU machine (16 cores: about 2.5 minutes for every
# instantiation) from the carried nvidia-cutlass wheel, so a device call needs no library built
# elsewhere:
#
#   OUT=$OUT bash lab/device_build.sh && python3 -m pytest -q tests ...
#
# Expects the wheel under .carry/ (pip download --no-deps nvidia-cutlass==<pinned> -d .carry) and
# must be sourced (`. lab/device_build.sh`) for PYTHONPATH to reach later commands. Writes
# the GPU and versions to $OUT/env.txt and the build log (ptxas report per file) to $OUT/build.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cutlass_flash_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/nvidia_cutlass-*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.limit --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.txt"
start=$(date +%s)
if ! CUTLASS_FLASH_JOBS=${CUTLASS_FLASH_JOBS:-16} python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  return 1
fi
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
grep -E "(compiled|nvcc) .*spill" "$OUT/build.log" | grep -v " 0 B spill" | head -20 || true
