#!/usr/bin/env bash
# ncu beside FlashAttention-3 on the sm90 family: each cell's main kernels (ours, then FA3's) with
# the speed-of-light, warp-state, memory and per-instruction stall (SourceCounters) sections, from
# a carried library:
#
#   LIB=.carry/s24/lib-70dca20.tgz FA3=.carry/fa3mla/fa3built.tgz OUT=$OUT \
#     bash lab/device_ncu_sm90.sh "bwd 192:128 4096 0" "fwd 192:128 4096 1"
#
# LIB: a tarball of cutlass_flash/libcutlass_flash_kernels.so (lab/device_mla.sh's lib.tgz); FA3:
# lab/device_fa3.sh's FA3_PACK tarball. Cells: as lab/profile_attn.py's arguments. Per cell, $OUT
# gets ncu-MODE-D-SEQLEN-CAUSAL.txt (details page, then the SASS with its stall samples, CSV).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/o}; LOGS=${LOGS:-/tmp/ncu_logs}; mkdir -p "$OUT" "$LOGS"
tar xzf "$LIB"
mkdir -p /tmp/fa3pkg && tar xzf "$FA3" -C /tmp/fa3pkg && export PYTHONPATH=$PYTHONPATH:/tmp/fa3pkg
. lab/device_lib.sh
binding
for cfg in "$@"; do
  set -- $cfg
  if [ "$1" = fwd ]; then re="sm90::fwd_kernel|FlashAttnFwdSm90"; else re="sm90::bwd_kernel|FlashAttnBwdSm90"; fi
  name="$1-${2/:/_}-$3-$4" rep="$LOGS/ncu-$name"
  timeout 240 ncu --kernel-name-base demangled --kernel-name regex:"$re" --launch-skip 1 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats \
    -f -o "$rep" python3 lab/profile_attn.py $cfg >"$LOGS/ncu-$name.log" 2>&1
  echo "$cfg: rc $?"; tail -3 "$LOGS/ncu-$name.log"
  {
    ncu --import "$rep.ncu-rep" --page details
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass
  } >"$OUT/ncu-$name.txt" 2>&1
  ls -la "$OUT/ncu-$name.txt"
done
