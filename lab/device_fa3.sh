#!/usr/bin/env bash
# Builds FlashAttention-3 (hopper/ of Dao-AILab/flash-attention) on the GPU machine for the
# benchmark's fa3 column, from .carry/fa3src.tar.gz (made by lab/pack_fa3src.sh; FA3's
# source is never committed here). No network: nothing is downloaded, nothing is pip-installed.
#
#   OUT=$OUT bash lab/device_fa3.sh & fa3=$!      # in the background, beside our build
#   ...; wait $fa3 && export PYTHONPATH=/tmp/fa3/hopper${PYTHONPATH:+:$PYTHONPATH}
#   . lab/device_fa3.sh                           # or in the foreground: sets PYTHONPATH
#
# Builds only what flash_attn_interface.flash_attn_func(q, k, v, causal=...) needs on dense
# batches, forward and backward: sm90, bf16/fp16, head dims 64/128/256 (12 kernel files). Any
# FLASH_ATTENTION_DISABLE_* set by the caller wins (e.g. =FALSE to build that feature back).
# FA3_CHECK: the "d:d_v" pairs the check runs (default "64:64 128:128 256:256"). MLA's (192, 128),
# bf16 only (3 kernel files; FA3's backward runs it on its d = 192 kernel, V zero-filled):
#   FLASH_ATTENTION_DISABLE_HDIM192=FALSE FLASH_ATTENTION_DISABLE_HDIMDIFF192=FALSE \
#   FLASH_ATTENTION_DISABLE_HDIM{64,128,256}=TRUE FLASH_ATTENTION_DISABLE_FP16=TRUE \
#   FA3_CHECK="192:192 192:128" FA3_PACK=1 bash lab/device_fa3.sh
# FA3_PATCH: a patch applied to FA3's source first (lab/fa3_stamps.patch).
# FA3_PACK=1: also writes the built module to $OUT/fa3built.tgz (split into 15 MiB parts where
# larger), to carry into a later call: untar it into a folder on PYTHONPATH.
# Writes the build log to $OUT/fa3_build.log and, when done, the exit status to
# $OUT/fa3_build.done; prints the build time and a small check against PyTorch's SDPA.
_fa3_build() {
  local out=${OUT:-/tmp/cutlass_flash_out} src=/tmp/fa3 start
  mkdir -p "$out" && rm -f "$out/fa3_build.done"
  rm -rf "$src" && mkdir -p "$src/shim" && tar -xzf .carry/fa3src.tar.gz -C "$src" || return 1
  cat "$src/SOURCE.txt"
  # setup.py runs `git submodule update --init ../csrc/cutlass` unconditionally (and dies if git
  # is missing); the tarball already holds csrc/cutlass/include, so a no-op git stands in.
  printf '#!/bin/sh\nexit 0\n' >"$src/shim/git" && chmod +x "$src/shim/git"
  # FA3_PATCH: a patch of FlashAttention-3's source applied before the build (a lab build, e.g.
  # lab/fa3_stamps.patch: its forward's per-tile clock stamps, read by lab/fa3_stamps.py).
  if [ -n "${FA3_PATCH:-}" ]; then patch -d "$src" -p1 <"$FA3_PATCH" || return 1; fi
  local f v
  # Features not needed for dense flash_attn_func: each skips kernel files or template branches.
  # PACKGQA/VARLEN only change GQA and varlen batches. The 2-CTA cluster forward (non-causal
  # d >= 128) stays: it is part of FA3's stock build.
  for f in SPLIT PAGEDKV APPENDKV LOCAL SOFTCAP PACKGQA FP8 VARLEN \
           HDIM96 HDIM192 HDIMDIFF64 HDIMDIFF192 SM80; do
    v=FLASH_ATTENTION_DISABLE_$f
    export "$v=${!v:-TRUE}"   # setup.py compares with the exact string TRUE
  done
  start=$(date +%s)
  # FORCE_BUILD: never look for a prebuilt wheel (only bdist_wheel would; harmless here).
  # OFFLINE_BUILD: never download nvcc 12.6/ptxas 12.8 (setup.py only tries under CUDA 12.x, not
  # 12.8; with nvcc 13.0 it uses the system nvcc and adds $CUDA_HOME/include/cccl itself).
  # MAX_JOBS: ninja's parallel jobs. NVCC_THREADS (default 2) only helps files with several
  # -gencode targets, and the sm90 kernel files have one. Run from hopper/: setup.py reads
  # ../README.md and writes flash_attn_config.py (imported by flash_attn_interface) to the cwd.
  if ! (cd "$src/hopper" && PATH="$src/shim:$PATH" FLASH_ATTENTION_FORCE_BUILD=TRUE \
        FLASH_ATTENTION_OFFLINE_BUILD=1 FLASH_ATTENTION_SKIP_CUDA_BUILD=FALSE \
        MAX_JOBS=${FA3_JOBS:-16} python3 setup.py build_ext --inplace) >"$out/fa3_build.log" 2>&1
  then
    tail -30 "$out/fa3_build.log"
    return 1
  fi
  echo "fa3 build: $(( $(date +%s) - start )) s" | tee -a "$out/fa3_build.log"
  # The fwd+bwd of every built head dim, causal or not, against SDPA's math in fp32.
  FA3_CHECK=${FA3_CHECK:-64:64 128:128 256:256} PYTHONPATH="$src/hopper" python3 - <<'EOF' 2>&1 \
    | tee -a "$out/fa3_build.log"
import os, torch, torch.nn.functional as F, flash_attn_interface as fa3
for d, dv in (tuple(map(int, pair.split(":"))) for pair in os.environ["FA3_CHECK"].split()):
    for causal in (False, True):
        q, k = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v, do = (torch.randn(2, 300, 4, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
        out = fa3.flash_attn_func(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        got = (out, *torch.autograd.grad(out, (q, k, v), do))
        t = [x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*t, is_causal=causal)
        ref = (ref.transpose(1, 2), *(g.transpose(1, 2) for g in torch.autograd.grad(ref, t, do.float().transpose(1, 2))))
        err = [f"{(a.float() - b).abs().max().item():.3f}" for a, b in zip(got, ref)]
        print(f"fa3 check d={d} d_v={dv} causal={int(causal)}: max|diff| out, dq, dk, dv = {', '.join(err)}")
EOF
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 0 ] && [ "${FA3_PACK:-0}" = 1 ]; then
    (cd "$src/hopper" && tar czf "$out/fa3built.tgz" flash_attn_3 flash_attn_interface.py flash_attn_config.py) &&
      if [ "$(stat -c %s "$out/fa3built.tgz")" -gt $((15 << 20)) ]; then
        split -b 15M -d "$out/fa3built.tgz" "$out/fa3built.tgz." && rm "$out/fa3built.tgz"
      fi
  fi
  return "$rc"
}
_fa3_build
_fa3_rc=$?
echo "$_fa3_rc" >"${OUT:-/tmp/cutlass_flash_out}/fa3_build.done"
if [ "$_fa3_rc" = 0 ]; then export PYTHONPATH=/tmp/fa3/hopper${PYTHONPATH:+:$PYTHONPATH}; fi
# Sourced: return the status; run with bash: exit with it.
return "$_fa3_rc" 2>/dev/null || exit "$_fa3_rc"
