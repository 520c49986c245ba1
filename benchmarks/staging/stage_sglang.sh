#!/usr/bin/env bash
# Stage SGLang 0.5.17 on the offline H200 machine (Python 3.12, torch 2.11.0+cu130), where each
# transfer carries at most ~64 MiB. 0.5.17 pins torch==2.11.0 and its kernels (sglang-kernel 0.4.5)
# are built with CUDA 13 (libcudart.so.13); it serves EAGLE-3 drafts (LlamaForCausalLMEagle3).
#
#   here:   benchmarks/staging/stage_sglang.sh pack      # .sglang/ (git-ignored): wheels, then parts of <= 52
#                                            # MiB, one folder each: .sglang/parts/1, /2, ...
#   there:  one back-to-back call per part (the machine must stay warm: /tmp survives only then),
#           each with carry [".sglang/parts/<k>"] and the command
#             benchmarks/staging/stage_sglang.sh install
#           which collects the part under /tmp/sgstage, says which parts are still missing, and once
#           all are there installs every wheel into /tmp/sgsite (once) and prints the exports.
#
# The bundle: sglang==0.5.17 and the pinned list benchmarks/staging/stage_sglang.txt (what the image lacks; that
# file says what is left out and why), less what an H200 never loads when serving with
# --attention-backend triton: in sglang-kernel the FlashAttention-3 kernels (flash_ops, 1.1 GB:
# --attention-backend fa3), the sm100 build of common_ops (sgl_kernel/load_utils.py loads sm90/ on
# compute capability 9.0) and the InfLLM-V2 kernels (MiniCPM4 sparse attention); in xgrammar the
# static library for C++ users. SGLANG_SLIM=0 keeps the wheels whole.
#
# The settings block below is SGLang's; the work is benchmarks/staging/stage_lib.sh's, shared with stage_vllm.sh.
set -euo pipefail
cmd=${1:?usage: stage_sglang.sh pack|install}
repo=$(cd "$(dirname "$0")/../.." && pwd)

tag=sglang
root=sglang==0.5.17
pins=$repo/benchmarks/staging/stage_sglang.txt
pack_rel=.sglang
pack_dir=$repo/$pack_rel
site=${SITE:-/tmp/sgsite}
stage=${STAGE:-/tmp/sgstage}
part_mib=${PART_MIB:-44}  # a call carries 64 MiB with the working tree (~13 MiB with the peers' shared set; test_lab checks it fits)
# "<wheel glob> <member> ...": members deleted from that wheel (and from its RECORD).
slim_rows=(
  "sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/common_ops.abi3.so sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"
  "xgrammar-0.2.1-*.whl xgrammar/lib/libxgrammar.a"
)
slim=${SGLANG_SLIM:-1}
# nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which Python reads only in
# site-packages, not in a PYTHONPATH folder: its folder goes on PYTHONPATH instead. The caches keep
# what sglang (tvm-ffi) and flashinfer compile with nvcc under /tmp.
exports="PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$repo PATH=$site/bin:\$PATH"
exports+=" HF_HUB_OFFLINE=1 TVM_FFI_CACHE_DIR=/tmp/sgcache/tvm-ffi FLASHINFER_WORKSPACE_BASE=/tmp/sgcache"

# shellcheck source=benchmarks/staging/stage_lib.sh
source "$repo/benchmarks/staging/stage_lib.sh"
