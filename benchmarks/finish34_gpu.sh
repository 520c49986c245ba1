#!/usr/bin/env bash
# What issue #34 still lacks, on a draft brought along (DRAFT, e.g. the recipe's export that
# recipe_speedup_gpu.sh bundled), one lease of one H200, as one background job from the repository
# root after benchmarks/staging/gpu_stage.sh (benchmarks/staging/stage_sglang.sh may finish while step 1 runs):
#   1. eagle3-eval decoder=graph at batch 37 (speedup_gpu.sh STEPS=geval, at most 300 s) while SGLang
#      stages: eval's speed-up with both decoders graph-captured;
#   2. SGLang serving chain-5 and the trees 4/5/16 and 8/7/64 at concurrency 1 (STEPS=sglang): its
#      acceptance length next to eagle3-eval's tree tau on the same draft (TREES=1 runs eval's trees
#      beside it; session 19 measured them on .draft/n4096, eval_trees_n4096_h200.json);
#   3. eagle3-eval decoder=graph at batch 1 (at most GEVAL_TIMEOUT, 480 s);
#   4. the MoE shape of the projection (bench_projection.py --shapes qwen3moe), the GPU idle;
#   5. where benchmarks/staging/stage_vllm.sh has installed vLLM: its bench with CUDA graphs at k=BENCH_K (7) drafts a
#      step, concurrency 1/4/16 (a draft whose later positions accept well may pay for a longer chain).
# Progress: $W/log; $W/done when finished; `bash benchmarks/study_speedup_gpu.sh bundle DIR` with
# W and DRAFT=/nonexistent packs the results.
#
#   W=/tmp/w DRAFT=/tmp/draft/export setsid nohup bash benchmarks/finish34_gpu.sh > /dev/null 2>&1 < /dev/null &
# A draft kept here travels in a call of its own (a call carries at most 64 MiB): put its export under the
# git-ignored .draft/ (session 19 kept .draft/n4096, chain-5 tau 1.36), carry [".draft"] and copy it to /tmp.
set -uo pipefail
W=${W:-/tmp/w}
DRAFT=${DRAFT:?DRAFT=<an exported draft directory>}
mkdir -p "$W"
rm -f "$W/done"
export EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export PYTHONPATH=${SITE:-/tmp/site}:$(pwd)
# shellcheck source=benchmarks/staging/engine_env.sh
source benchmarks/staging/engine_env.sh
{
  echo "== $(date +%T) 1. eagle3-eval decoder=graph at batch 37 while SGLang stages ($DRAFT)"
  W="$W" DRAFT="$DRAFT" STEPS=geval GEVAL_BATCHES=37 GEVAL_TIMEOUT=300 bash benchmarks/speedup_gpu.sh
  echo "== $(date +%T) 2. SGLang chain-5 and trees${TREES:+, eval trees beside}"
  [[ -n "${TREES:-}" ]] && { W="$W" DRAFT="$DRAFT" STEPS=tree bash benchmarks/speedup_gpu.sh & }
  for _ in $(seq 1 40); do compgen -G "$SGSITE/.stage_sglang-*" > /dev/null && break; sleep 15; done
  if compgen -G "$SGSITE/.stage_sglang-*" > /dev/null; then
    "${sglang_env[@]}" W="$W/sglang" DRAFT="$DRAFT" STEPS=sglang SGLANG_MEM=0.4 SGLANG_CONCURRENCY="[1]" \
      bash benchmarks/speedup_gpu.sh
  else
    echo "SGLang is not staged: skipped"
  fi
  wait
  echo "== $(date +%T) 3. eagle3-eval decoder=graph at batch 1"
  W="$W" DRAFT="$DRAFT" STEPS=geval GEVAL_BATCHES=1 bash benchmarks/speedup_gpu.sh
  echo "== $(date +%T) 4. the projection's MoE shape"
  W="$W" STEPS=moe DRAFT="$DRAFT" bash benchmarks/speedup_gpu.sh
  if compgen -G "$VSITE/.stage_vllm-*" > /dev/null; then
    echo "== $(date +%T) 5. vLLM with CUDA graphs at k=${BENCH_K:-7}"
    mkdir -p "$W/k${BENCH_K:-7}"
    "${vllm_env[@]}" W="$W/k${BENCH_K:-7}" DRAFT="$DRAFT" MODES=graphs STEPS=bench \
      BENCH_EXTRA="num_speculative_tokens=${BENCH_K:-7} concurrency=[1,4,16]" bash benchmarks/speedup_gpu.sh
  fi
  echo "== $(date +%T) all done"
  touch "$W/done"
} >> "$W/log" 2>&1
