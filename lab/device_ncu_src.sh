#!/usr/bin/env bash
# ncu's per-instruction stall samples (SourceCounters) of the sm80 family (forced) beside SDPA's
# FlashAttention-2, for the cells given as "MODE D SEQLEN CAUSAL" arguments (default: the forward
# cells issue 32 has below its bar):
#
#   OUT=$OUT bash lab/device_ncu_src.sh "fwd 256 2048 0" "fwd 64 1024 0"
#
# Per cell, $OUT gets ncu-src-MODE-D-SEQLEN-CAUSAL.txt: each profiled kernel's summary sections
# (details page) and its SASS with the warp stall samples per instruction (source page, CSV).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/o}; LOGS=${LOGS:-/tmp/ncu_logs}; mkdir -p "$OUT" "$LOGS"
. lab/device_lib.sh
binding
[ $# -gt 0 ] || set -- "fwd 256 2048 0" "fwd 64 1024 0"
for cfg in "$@"; do
  set -- $cfg
  if [ "$1" = fwd ]; then re="fwd_kernel|flash_fwd_kernel"; n=3; else re="bwd_kernel|flash_bwd_dq_dk_dv_loop"; n=2; fi
  name="$1-$2-$3-$4" rep="$LOGS/src-$1-$2-$3-$4"
  CUTLASS_FLASH_FORCE_ARCH=80 timeout 240 ncu --kernel-name regex:"$re" --launch-skip 1 --launch-count $n \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    --section LaunchStats -f -o "$rep" python3 lab/profile_attn.py $cfg fa2 >"$LOGS/ncu-$name.log" 2>&1
  echo "$cfg: rc $?"
  {
    ncu --import "$rep.ncu-rep" --page details
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass
  } >"$OUT/ncu-src-$name.txt" 2>&1
done
