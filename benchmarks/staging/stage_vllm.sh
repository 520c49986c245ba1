#!/usr/bin/env bash
# Stage vLLM 0.26.0 on the offline H200 machine (Python 3.12, torch 2.11.0+cu130), where each
# transfer carries at most ~64 MiB. 0.26.0 is the newest vLLM whose wheel pins torch==2.11.0 (0.22.0
# to 0.26.0 do; 0.27.0 to 0.32.0 pin 2.13.0, 0.33.0 2.14.0); its kernels are built with CUDA 13.0
# (libcudart.so.13) and it has extract_hidden_states, ExampleHiddenStatesConnector and EAGLE-3 drafts.
#
#   here:   benchmarks/staging/stage_vllm.sh pack      # .vllm/ (git-ignored): wheels, then parts of <= 44 MiB,
#                                          # one folder each: .vllm/parts/1, .vllm/parts/2, ...
#   there:  one back-to-back call per part (the machine must stay warm: /tmp survives only then),
#           each with carry [".vllm/parts/<k>"] and the command
#             benchmarks/staging/stage_vllm.sh install
#           which collects the part under /tmp/vstage, says which parts are still missing, and once
#           all are there installs every wheel into /tmp/vsite (once) and prints the exports.
#
# The bundle: vllm==0.26.0 without two files it does not need on an H200 (the FlashAttention-2
# kernels, sm90 runs FA3; the opt-in Rust frontend binary): 151 MiB instead of 290. The fused-MoE
# kernels stay (MoE targets: qwen3_moe, deepseek_v3, gpt_oss); VLLM_DROP_MOE=1 drops them too (112 MiB,
# dense targets only). VLLM_SLIM=0 keeps the wheel whole. Its dependencies are the pinned list
# benchmarks/staging/stage_vllm.txt (what the image lacks; that file says what is left out and why).
set -euo pipefail
cmd=${1:?usage: stage_vllm.sh pack|install}
repo=$(cd "$(dirname "$0")/../.." && pwd)

tag=vllm
root=vllm==0.26.0
pins=$repo/benchmarks/staging/stage_vllm.txt
pack_rel=.vllm
pack_dir=$repo/$pack_rel
site=${SITE:-/tmp/vsite}
stage=${STAGE:-/tmp/vstage}
part_mib=${PART_MIB:-44}  # a call carries 64 MiB with the working tree (~13 MiB with the peers' shared set; test_lab checks it fits)
# Inside the vllm wheel: never loaded on sm90 (and, with VLLM_DROP_MOE=1, for a dense target).
drop="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs"
[ "${VLLM_DROP_MOE:-0}" = 1 ] && drop+=" vllm/_moe_C_stable_libtorch.abi3.so"
slim_rows=("vllm-0.26.0-*.whl $drop")
slim=${VLLM_SLIM:-1}
exports="PYTHONPATH=$site:/tmp/site:$repo PATH=$site/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0"
exports+=" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"

# shellcheck source=benchmarks/staging/stage_lib.sh
source "$repo/benchmarks/staging/stage_lib.sh"
