#!/usr/bin/env bash
# Stage vLLM 0.26.0 on the offline H200 machine (Python 3.12, torch 2.11.0+cu130), where each
# transfer carries at most ~64 MiB. 0.26.0 is the newest vLLM whose wheel pins torch==2.11.0 (0.22.0
# to 0.26.0 do; 0.27.0 to 0.32.0 pin 2.13.0, 0.33.0 2.14.0); its kernels are built with CUDA 13.0
# (libcudart.so.13) and it has extract_hidden_states, ExampleHiddenStatesConnector and EAGLE-3 drafts.
#
#   here:   launch/stage_vllm.sh pack      # .vllm/ (git-ignored): wheels, then parts of <= 60 MiB,
#                                          # one folder each: .vllm/parts/1, .vllm/parts/2, ...
#   there:  one back-to-back call per part (the machine must stay warm: /tmp survives only then),
#           each with carry [".vllm/parts/<k>"] and the command
#             launch/stage_vllm.sh install
#           which collects the part under /tmp/vstage, says which parts are still missing, and once
#           all are there installs every wheel into /tmp/vsite (once) and prints the exports.
#
# The bundle: vllm==0.26.0 without two files it does not need on an H200 (the FlashAttention-2
# kernels, sm90 runs FA3; the opt-in Rust frontend binary): 151 MiB instead of 290. The fused-MoE
# kernels stay (MoE targets: qwen3_moe, deepseek_v3, gpt_oss); VLLM_DROP_MOE=1 drops them too (112 MiB,
# dense targets only). VLLM_SLIM=0 keeps the wheel whole. Its dependencies are the pinned list
# launch/stage_vllm.txt (what the image lacks; that file says what is left out and why).
set -euo pipefail
cmd=${1:?usage: stage_vllm.sh pack|install}
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${SITE:-/tmp/vsite}
stage=${STAGE:-/tmp/vstage}
part_mib=60
# Inside the vllm wheel: never loaded on sm90 (and, with VLLM_DROP_MOE=1, for a dense target).
slim_out=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs)
[ "${VLLM_DROP_MOE:-0}" = 1 ] && slim_out+=(vllm/_moe_C_stable_libtorch.abi3.so)

case $cmd in
pack)
  dir=$repo/.vllm
  mkdir -p "$dir/whl"
  platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir/whl" vllm==0.26.0 -r "$repo/launch/stage_vllm.txt"
  rm -rf "$dir/bundle" "$dir/parts"
  mkdir -p "$dir/bundle" "$dir/parts"
  cp "$dir"/whl/*.whl "$dir/bundle/"
  if [ "${VLLM_SLIM:-1}" = 1 ]; then
    whl=$(ls "$dir"/bundle/vllm-0.26.0-*.whl)
    record=vllm-0.26.0.dist-info/RECORD
    zip -q -d "$whl" "${slim_out[@]}"
    tmp=$(mktemp -d)
    unzip -q -d "$tmp" "$whl" "$record"
    for f in "${slim_out[@]}"; do grep -v -F "$f," "$tmp/$record" > "$tmp/RECORD.new"; mv "$tmp/RECORD.new" "$tmp/$record"; done
    (cd "$tmp" && zip -q "$whl" "$record")
    rm -rf "$tmp"
  fi
  # One tar of all wheels, split; parts are named by the tar's hash so parts of two packs never mix.
  tar -cf "$dir/bundle.tar" -C "$dir/bundle" .
  id=$(sha256sum "$dir/bundle.tar" | cut -c1-12)
  split -b "${part_mib}M" -d -a 2 "$dir/bundle.tar" "$dir/parts/chunk-"
  chunks=("$dir"/parts/chunk-*)
  n=${#chunks[@]}
  for i in "${!chunks[@]}"; do
    k=$((i + 1))
    mkdir "$dir/parts/$k"
    mv "${chunks[$i]}" "$dir/parts/$k/vllm-$id-part-$k-of-$n"
  done
  (cd "$dir/parts" && sha256sum */vllm-"$id"-part-* | sed 's#  [0-9]*/#  #') > "$dir/SHA256SUMS"
  for k in $(seq 1 "$n"); do cp "$dir/SHA256SUMS" "$dir/parts/$k/"; done
  rm "$dir/bundle.tar"
  echo "stage_vllm: $(ls "$dir"/bundle/*.whl | wc -l) wheels, $(du -sm "$dir/bundle" | cut -f1) MiB -> $n parts (bundle $id):"
  du -m "$dir"/parts/*/vllm-* | sed "s#$dir/##"
  echo "stage_vllm: one device call per part, carry [\".vllm/parts/<k>\"], command: launch/stage_vllm.sh install"
  ;;
install)
  mkdir -p "$stage"
  for sums in "$repo"/.vllm/parts/*/SHA256SUMS; do
    [ -f "$sums" ] || continue
    for part in "$(dirname "$sums")"/vllm-*-part-*; do
      name=$(basename "$part")
      [ -f "$part" ] && [ ! -f "$stage/$name" ] || continue
      cp "$part" "$sums" "$stage/"
      if ! (cd "$stage" && grep -F "  $name" SHA256SUMS | sha256sum -c --quiet -); then
        rm -f "$stage/$name"
        echo "stage_vllm: $name arrived damaged (sha256 mismatch): carry it again" >&2
        exit 1
      fi
      echo "stage_vllm: received $name"
    done
  done
  [ -f "$stage/SHA256SUMS" ] || { echo "stage_vllm: no part here yet: carry .vllm/parts/<k>" >&2; exit 1; }
  mapfile -t names < <(awk '{print $2}' "$stage/SHA256SUMS")
  id=${names[0]#vllm-}
  id=${id%%-part-*}
  missing=()
  for name in "${names[@]}"; do [ -f "$stage/$name" ] || missing+=("${name#vllm-"$id"-part-}"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "stage_vllm: $((${#names[@]} - ${#missing[@]})) of ${#names[@]} parts here; still missing: ${missing[*]}"
    exit 0
  fi
  if [ ! -f "$site/.stage_vllm-$id" ]; then
    rm -rf "$stage/whl"
    mkdir -p "$stage/whl" "$site"
    for name in "${names[@]}"; do cat "$stage/$name"; done | tar -xf - -C "$stage/whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$stage"/whl/*.whl
    touch "$site/.stage_vllm-$id"
    echo "stage_vllm: installed $(ls "$stage"/whl/*.whl | wc -l) wheels into $site"
  else
    echo "stage_vllm: bundle $id already installed in $site"
  fi
  # What vllm and the staged packages ask for that this Python does not have (with $site first on
  # sys.path, as it will be): the packages left out on purpose show up here too.
  PYTHONPATH=$site python3 - "$site" <<'PY'
import sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.markers import default_environment

env = default_environment() | {"extra": ""}
unmet = set()
for dist in metadata.distributions(path=[sys.argv[1]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate(env):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            unmet.add(f"{req.name}{req.specifier} (have {have or 'none'}) for {dist.metadata['Name']}")
print("stage_vllm: unmet requirements:" if unmet else "stage_vllm: every requirement met")
for line in sorted(unmet):
    print("  " + line)
PY
  echo "stage_vllm: export PYTHONPATH=$site:/tmp/site:$repo PATH=$site/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0" \
    "HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"
  ;;
*)
  echo "usage: stage_vllm.sh pack|install" >&2
  exit 2
  ;;
esac
