#!/usr/bin/env bash
# Packs FlashAttention-3's source (hopper/ of Dao-AILab/flash-attention) and the CUTLASS headers its
# csrc/cutlass submodule pins into .carry/fa3src.tar.gz (git-ignored: FA3's source is never
# committed here), for lab/device_fa3.sh to build on the GPU machine:
#
#   bash lab/pack_fa3src.sh FLASH_ATTENTION_GIT_DIR CUTLASS_GIT_DIR [FA3_COMMIT]
#
# Both git dirs may be bare mirrors. Only what hopper/setup.py compiles goes in: no tests,
# benchmarks, docs or examples; of CUTLASS only include/ (FA3 includes no tools/util headers).
set -euo pipefail
fa=$1 cu=$2 rev=${3:-HEAD}
fa_sha=$(git --git-dir="$fa" rev-parse "$rev^{commit}")
# The submodule's pinned commit at that flash-attention commit (160000 entry of csrc/cutlass).
cu_sha=$(git --git-dir="$fa" ls-tree "$fa_sha" csrc/cutlass | awk '{print $3}')
git --git-dir="$cu" cat-file -e "$cu_sha^{commit}"  # fails if the mirror lacks the pinned commit
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# setup.py reads ../README.md (long_description), so the top-level README must come too.
git --git-dir="$fa" archive "$fa_sha" -- README.md LICENSE hopper \
  ':(exclude)hopper/test_*' ':(exclude)hopper/benchmark_*' ':(exclude)hopper/padding.py' \
  | tar -x -C "$stage"
git --git-dir="$cu" archive --prefix=csrc/cutlass/ "$cu_sha" -- include LICENSE.txt | tar -x -C "$stage"
{
  echo "flash-attention $fa_sha $(git --git-dir="$fa" log -1 --format=%cs "$fa_sha")"
  echo "cutlass $cu_sha $(git --git-dir="$cu" describe --tags "$cu_sha" 2>/dev/null || true)"
} >"$stage/SOURCE.txt"
root=$(git rev-parse --show-toplevel)
mkdir -p "$root/.carry"
# Sorted names, fixed times and owners: the same commits give the same tarball.
tar -C "$stage" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . \
  | gzip -9n >"$root/.carry/fa3src.tar.gz"
cat "$stage/SOURCE.txt"
ls -l "$root/.carry/fa3src.tar.gz"
