#!/usr/bin/env bash
# Stage SGLang 0.5.14 on the offline H200 machine (Python 3.12, torch 2.11.0+cu130), where each
# transfer carries at most ~64 MiB, for SpecForge 0.2.0's hidden-state capture, which runs on sglang
# 0.5.14 only (stage_sglang.sh stages 0.5.17, for serving). 0.5.14 pins torch==2.11.0 and its kernels
# (sglang-kernel 0.4.4) are built with CUDA 13 (libcudart.so.13). It pins transformers==5.8.1 and does
# not import beside the image's 5.17, so this site carries 5.8.1 and must come first on PYTHONPATH.
#
#   here:   benchmarks/staging/stage_sglang14.sh pack    # .sglang14/ (git-ignored): wheels, then parts of <= 52
#                                            # MiB, one folder each: .sglang14/parts/1, /2, ...
#   there:  one back-to-back call per part (the machine must stay warm: /tmp survives only then),
#           each with carry [".sglang14/parts/<k>"] and the command
#             benchmarks/staging/stage_sglang14.sh install
#           which collects the part under /tmp/sg14stage, says which parts are still missing, and once
#           all are there installs every wheel into /tmp/sg14site (once) and prints the exports.
#
# The bundle: sglang==0.5.14 and the pinned list benchmarks/staging/stage_sglang14.txt (what the image lacks;
# that file says what is left out and why), less what an H200 never loads when serving with
# --attention-backend triton: in sglang-kernel the FlashAttention-3 kernels (flash_ops, 1.8 GB:
# --attention-backend fa3) and the sm100 build of common_ops (sgl_kernel/load_utils.py loads sm90/ on
# compute capability 9.0); in xgrammar the static library for C++ users. SGLANG_SLIM=0 keeps the
# wheels whole.
#
# The settings block below is SGLang 0.5.14's; the work is benchmarks/staging/stage_lib.sh's, shared with
# stage_sglang.sh and stage_vllm.sh.
set -euo pipefail
cmd=${1:?usage: stage_sglang14.sh pack|install}
repo=$(cd "$(dirname "$0")/../.." && pwd)

tag=sglang14
root=sglang==0.5.14
pins=$repo/benchmarks/staging/stage_sglang14.txt
pack_rel=.sglang14
pack_dir=$repo/$pack_rel
site=${SITE:-/tmp/sg14site}
stage=${STAGE:-/tmp/sg14stage}
part_mib=${PART_MIB:-44}  # a call carries 64 MiB with the working tree (~13 MiB with the peers' shared set; test_lab checks it fits)
# "<wheel glob> <member> ...": members deleted from that wheel (and from its RECORD).
slim_rows=(
  "sglang_kernel-0.4.4-*.whl sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100/common_ops.abi3.so"
  "xgrammar-0.2.1-*.whl xgrammar/lib/libxgrammar.a"
)
slim=${SGLANG_SLIM:-1}
# $site first, so that its transformers 5.8.1 and tokenizers 0.22.2 shadow the image's; /tmp/site
# (the project's own wheels) after it. No nvidia-cutlass-dsl here (stage_sglang14.txt says why), so no
# folder of its on PYTHONPATH. The caches keep what sglang (tvm-ffi) and flashinfer compile with nvcc
# under /tmp, apart from stage_sglang.sh's (another tvm-ffi and flashinfer).
exports="PYTHONPATH=$site:/tmp/site:$repo PATH=$site/bin:\$PATH"
exports+=" HF_HUB_OFFLINE=1 TVM_FFI_CACHE_DIR=/tmp/sg14cache/tvm-ffi FLASHINFER_WORKSPACE_BASE=/tmp/sg14cache"

# shellcheck source=benchmarks/staging/stage_lib.sh
source "$repo/benchmarks/staging/stage_lib.sh"
