# shellcheck shell=bash
# The environments the serving engines run in on a GPU machine staged by benchmarks/staging/gpu_stage.sh (/tmp/site),
# benchmarks/staging/stage_vllm.sh (/tmp/vsite) and benchmarks/staging/stage_sglang.sh (/tmp/sgsite): source it from the
# repository root, then run a command in one with "${vllm_env[@]}" cmd ... or "${sglang_env[@]}" cmd ...
# (the stage scripts print the same exports).
SITE=${SITE:-/tmp/site} VSITE=${VSITE:-/tmp/vsite} SGSITE=${SGSITE:-/tmp/sgsite}
REPO=${REPO:-$(pwd)}
# shellcheck disable=SC2034  # used by the scripts that source this file
vllm_env=(env "PYTHONPATH=$VSITE:$SITE:$REPO" "PATH=$VSITE/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1)
# shellcheck disable=SC2034
sglang_env=(env "PYTHONPATH=$SGSITE:$SGSITE/nvidia_cutlass_dsl/dsl_packages:$SITE:$REPO" "PATH=$SGSITE/bin:$PATH"
  HF_HUB_OFFLINE=1 TVM_FFI_CACHE_DIR=/tmp/sgcache/tvm-ffi FLASHINFER_WORKSPACE_BASE=/tmp/sgcache)
