#!/usr/bin/env bash
# Issue #34's measurements on one H200, as one background job (run from the repository root on a
# machine staged with benchmarks/staging/gpu_stage.sh and benchmarks/staging/stage_vllm.sh, PYTHONPATH and EAGLE3_CACHE set):
#   1. the recipe's draft for the embedded target (benchmarks/smollm2_synth.sh, NGPU=1, N
#      conversations; DRAFT=<an export> skips it);
#   2. eagle3-bench in vLLM, eager and with CUDA graphs: concurrency 1/4/16/64, greedy, 256 new tokens;
#   3. eagle3-eval of the same draft on 512 and 1024 new tokens (tau by reply position);
#   4. eagle3-eval tree drafts at SGLang's usual settings (topk / steps / draft tokens) next to chain-5;
#   5. (STEPS=geval) eagle3-eval decoder=graph at batch 1 and 37 (GEVAL_BATCHES), 256 new tokens, bf16 (GEVAL_DTYPE), each
#      stopped after GEVAL_TIMEOUT (480) s, its per-turn progress in its log: eval's
#      speculative decoding against its plain greedy, both graph-captured;
#   6. (STEPS=moe) the MoE shape of the projection (bench_projection.py --shapes qwen3moe), the GPU idle;
#   7. (STEPS=sglang, after benchmarks/staging/stage_sglang.sh) SGLang serving chain-5 and two trees (SGLANG_TREES,
#      "topk steps tokens,...") through eagle3-bench (concurrency SGLANG_CONCURRENCY): its acceptance
#      length next to eval's tree tau (both on SGLANG_NEW_TOKENS, default 128, new tokens). SGLANG_ARGS
#      (default "--attention-backend triton --sampling-backend pytorch") are added to both engines:
#      the staged bundle leaves out sgl_kernel's FlashAttention-3
#      build, and SGLang 0.5.17 picks fa3 on an H200 when no backend is named (its server then exits with
#      "Can not import FA3 in sgl_kernel"; measured in session 18).
# Each step keeps its results under $W whatever the later ones do (bench_*/results.json,
# eval_*/report.json); progress: $W/log. STEPS (default "bench long tree") picks the steps after the
# draft; MODES ("eager graphs") picks the vLLM modes of the bench; BENCH_EXTRA adds eagle3-bench
# overrides to the vLLM bench (min_requests=8); SGLANG_CONCURRENCY sets the SGLang bench's levels
# ([1,16]); EVAL_EXTRA adds eagle3-eval overrides (a CPU dry run: STEPS="long tree"
# DRAFT=runs/demo/export EVAL_EXTRA="limit=2 max_new_tokens=16").
#
#   W=/tmp/w N=32768 EPOCHS=6 setsid nohup bash benchmarks/speedup_gpu.sh > /dev/null 2>&1 &
set -uo pipefail
W=${W:-/tmp/w}
mkdir -p "$W"
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
EVAL="python3 -m eagle3_train.evaluation.eval target=embedded prompts=$PROMPTS/heldout.jsonl dtype=float32 batch_size=37 progress=false plot=false"
STEPS=" ${STEPS:-bench long tree} "
{
  echo "== $(date +%T) target directory"
  TDIR=$(python3 -c "from eagle3_train.targets import load_target; import os; print(load_target('embedded', cache_dir=os.environ.get('EAGLE3_CACHE', os.path.expanduser('~/.cache/eagle3_train'))).local_dir)" | tail -1)
  echo "$TDIR"
  if [ -z "${DRAFT:-}" ]; then
    echo "== $(date +%T) the recipe's draft: N=${N:-32768} EPOCHS=${EPOCHS:-6}"
    NGPU=1 N="${N:-32768}" EPOCHS="${EPOCHS:-6}" RUN_DIR="$W/recipe" bash benchmarks/smollm2_synth.sh \
      > "$W/recipe.log" 2>&1 || echo "the recipe failed (see $W/recipe.log)"
    DRAFT="$W/recipe/export"
  fi
  for mode in ${MODES:-eager graphs}; do
    [[ "$STEPS" == *" bench "* ]] || break
    args="--dtype bfloat16"
    [ "$mode" = eager ] && args="$args --enforce-eager"
    echo "== $(date +%T) eagle3-bench, vLLM $mode"
    # shellcheck disable=SC2086  # BENCH_EXTRA is a list of overrides
    timeout "${BENCH_TIMEOUT:-600}" python3 -m eagle3_train.evaluation.bench target="$TDIR" draft="$DRAFT" \
      out="$W/bench_$mode" max_new_tokens=256 plot=false "engine_args=$args" ${BENCH_EXTRA:-} > "$W/bench_$mode.log" 2>&1 \
      || echo "bench $mode: exit $? (see $W/bench_$mode.log)"
  done
  for long in 512 1024; do
    [[ "$STEPS" == *" long "* ]] || break
    echo "== $(date +%T) eagle3-eval, $long new tokens"
    # shellcheck disable=SC2086
    $EVAL draft="$DRAFT" k=5 max_new_tokens=$long ${EVAL_EXTRA:-} out="$W/eval_$long" > "$W/eval_$long.log" 2>&1 \
      || echo "eval $long: exit $? (see $W/eval_$long.log)"
  done
  for tree in "1 5 6" "4 3 8" "4 5 16" "8 5 32" "8 7 64"; do  # topk, steps, draft tokens ("1 5 6": chain-5)
    [[ "$STEPS" == *" tree "* ]] || break
    # shellcheck disable=SC2086
    set -- $tree
    echo "== $(date +%T) eagle3-eval, tree topk=$1 num_steps=$2 num_draft_tokens=$3"
    # shellcheck disable=SC2086
    $EVAL draft="$DRAFT" k="$2" topk="$1" num_steps="$2" num_draft_tokens="$3" max_new_tokens=128 ${EVAL_EXTRA:-} \
      out="$W/eval_tree_$1_$2_$3" > "$W/eval_tree_$1_$2_$3.log" 2>&1 || echo "tree $tree: exit $?"
  done
  for bs in ${GEVAL_BATCHES:-1 37}; do  # eval's own decoder, graph-captured: the speed-up over graph-captured greedy
    [[ "$STEPS" == *" geval "* ]] || break
    echo "== $(date +%T) eagle3-eval decoder=graph, batch $bs, ${GEVAL_DTYPE:-bfloat16}"
    timeout "${GEVAL_TIMEOUT:-480}" python3 -m eagle3_train.evaluation.eval target=embedded prompts="$PROMPTS/heldout.jsonl" \
      draft="$DRAFT" k=5 decoder=graph batch_size=$bs dtype="${GEVAL_DTYPE:-bfloat16}" max_new_tokens=256 plot=false \
      out="$W/eval_graph_b$bs" > "$W/eval_graph_b$bs.log" 2>&1 || echo "graph eval batch $bs: exit $?"
  done
  IFS=, read -ra sg_trees <<< "${SGLANG_TREES:-1 5 6,4 5 16,8 7 64}"  # "topk steps tokens,..."
  for tree in "${sg_trees[@]}"; do
    [[ "$STEPS" == *" sglang "* ]] || break
    # shellcheck disable=SC2086
    set -- $tree
    echo "== $(date +%T) eagle3-bench, SGLang topk=$1 num_steps=$2 num_draft_tokens=$3"
    timeout "${BENCH_TIMEOUT:-600}" python3 -m eagle3_train.evaluation.bench engine=sglang target="$TDIR" draft="$DRAFT" \
      out="$W/bench_sglang_$1_$2_$3" max_new_tokens="${SGLANG_NEW_TOKENS:-128}" plot=false concurrency="${SGLANG_CONCURRENCY:-[1,16]}" num_speculative_tokens="$2" \
      "engine_args=--mem-fraction-static ${SGLANG_MEM:-0.5} ${SGLANG_ARGS---attention-backend triton --sampling-backend pytorch}" \
      "spec_args=--speculative-eagle-topk $1 --speculative-num-draft-tokens $3" \
      > "$W/bench_sglang_$1_$2_$3.log" 2>&1 || echo "sglang bench $tree: exit $?"
  done
  if [[ "$STEPS" == *" moe "* ]]; then
    echo "== $(date +%T) the projection's MoE shape"
    timeout 300 python3 benchmarks/bench_projection.py --out "$W/projection_moe.json" --shapes qwen3moe --repeats 3 \
      > "$W/projection_moe.log" 2>&1 || echo "projection: exit $?"
  fi
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
