#!/usr/bin/env bash
# Side by side with the peer frameworks on one GPU: the embedded SmolLM2-135M-Instruct, the same
# synthesized conversations (the smollm2 recipe's, saved by `eagle3-run recipe=smollm2 until=prepare
# ++prepare.save_conversations=...`), each framework's own EAGLE-3 training with its own defaults,
# then one yardstick for every draft: eagle3-eval (chain k=5, greedy, fp32, lossless-checked) on the
# shipped held-out prompts and on MT-bench (both turns). Notes: notes/peer_training.md (commands and
# traps), notes/peer_forward.md (what the engines compute for each export).
#
#   here:  bash benchmarks/peers_gpu.sh pack MODELOPT_EXAMPLES MTBENCH_QUESTIONS
#            .peers/whl: the peers' wheels (nvidia-modelopt + pulp, speculators + hs-connectors, specforge + yunchang);
#            .peers/modelopt_ex: ModelOpt's examples/speculative_decoding launcher (GitHub only);
#            .peers/data: the conversations (already there) and MT-bench's question.jsonl
#   there: benchmarks/staging/gpu_stage.sh install   (our wheels and the embedded target, as usual)
#          bash benchmarks/peers_gpu.sh stage         (in the call that carries .peers: it copies it to /tmp)
#          bash benchmarks/peers_gpu.sh start session_modelopt [BUDGET_S]   detached (session_speculators
#            [BUDGET_S|epoch] [N], session_pair [BUDGET_S|epoch] [N] [MODELOPT_STEPS_PER_S], session_specforge [N])
#          bash benchmarks/peers_gpu.sh poll SECONDS DEST          back to back until it prints "ended"
#            (DEST/poll.tgz: everything so far; here: tar xzf it into a folder for peers_results.py)
#
# session_modelopt: ModelOpt's steady rate from a short run (its progress bar after the first tenth,
# compilation left out), then BUDGET_S seconds of its steps (batch 1, one epoch: as many conversations
# as steps); ours on the same conversations for one epoch; ours for ModelOpt's training-loop minutes
# (HF Trainer's train_runtime) over the whole set with train.max_minutes (neither peer stops on
# wall-clock time: its steps are sized from the measured rate); eval of the three on the held-out
# prompts, then on MT-bench. session_speculators: the same with speculators (its states from vLLM),
# and each draft served by vLLM for its acceptance length. session_pair: speculators (one epoch of N),
# ours for its loop minutes over the whole set and on its N conversations (one epoch), ModelOpt for its
# loop minutes at its rate from an earlier session;
# all three evaluated and served (fits one 30-minute device session at N=8192). session_specforge [N]:
# SpecForge's trainer and export on features from an HF forward (benchmarks/peers_specforge.py;
# its own capture needs SGLang 0.5.14), then ours for its loop minutes; both evaluated and served.
# /tmp/po holds phases.jsonl (fw, phase, seconds, start, end), smi.csv (GPU memory every 2 s), each
# framework's export and eval reports. CPU=1 runs it on a CPU machine with a tiny target
# (TARGET=<hf dir>) to test this script: vLLM is then a stand-in (benchmarks/peers_vllm_standin.py for
# speculators' states, tests/standin_engines.py serving each draft as eval computes it for vLLM).
set -euo pipefail
cmd=${1:?usage: peers_gpu.sh pack|stage|start|poll|job ...}
repo=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-/tmp/peers}
po=${PO:-/tmp/po}
data_set=smollm2_synth_73728.jsonl.gz
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache}

phase() {  # phase FW NAME command...: run it, append {fw, phase, seconds, start, end, rc} to $po/phases.jsonl
  # and return its status (set -e does not hold where a caller tests the result, e.g. `phase ... | tee ... || ...`)
  local fw=$1 name=$2 rc=0; shift 2
  local t0; t0=$(date +%s.%N)
  "$@" || rc=$?
  python3 -c "import json,sys; a,b=float(sys.argv[3]),float(sys.argv[4]); print(json.dumps({'fw': sys.argv[1], 'phase': sys.argv[2], 'seconds': round(b-a,1), 'start': a, 'end': b, 'rc': int(sys.argv[5])}))" \
    "$fw" "$name" "$t0" "$(date +%s.%N)" "$rc" >> "$po/phases.jsonl"
  if [ "$rc" = 0 ]; then echo "peers_gpu: $fw $name done"; else echo "peers_gpu: $fw $name failed (rc $rc)"; fi
  return "$rc"
}

go_on() {  # go_on command...: a step whose failure the session notes and goes past (an eval, a serve)
  "$@" || echo "peers_gpu: '$*' failed (rc $?); the session goes on" | tee -a "$po/session.txt"
}

held_out() {  # held_out FW: FW's draft evaluated (vLLM's rule) and served by vLLM on the held-out prompts
  go_on evaluate "$1" heldout vllm
  go_on served "$1"
}

as_conversations() {  # as_conversations IN OUT: the chats with their turns under `conversations`, the one key
  # speculators' and SpecForge's readers take (not `messages`)
  python3 -c "import json,sys; [print(json.dumps({'conversations': json.loads(l)['messages']})) for l in open(sys.argv[1])]" \
    "$1" > "$2"
}

target_dir() {  # the HF directory of the target (the embedded GGUF, converted once)
  if [ -n "${TARGET:-}" ]; then echo "$TARGET"; return; fi
  python3 -c "from eagle3_train.targets import _local_dir; print(_local_dir('embedded', '$EAGLE3_CACHE'))"
}

subset() {  # subset N: the first N conversations of the shared set -> $po/convs_N.jsonl
  local n=$1 out=$po/convs_$1.jsonl
  [ -f "$out" ] || zcat "$peers/data/$data_set" | head -n "$n" > "$out"
  echo "$out"
}

evaluate() {  # evaluate FW SET ENGINE [as_trained]: eagle3-eval of $po/FW/export on heldout (shipped) or mtbench
  local fw=$1 set=$2 engine=$3 target=${TARGET:-embedded} size=(++max_new_tokens=128) tag=$2
  [ "${4:-}" = as_trained ] && size+=(++as_trained=true) && tag=${set}_as_trained
  [ "${CPU:-0}" = 1 ] && size=(++max_new_tokens=16 ++limit=4)
  local prompts=$repo/data_prep/prompts/heldout.jsonl batch=37
  [ "$set" = mtbench ] && prompts=$peers/data/mt_bench_question.jsonl batch=80
  phase "$fw" "eval_$tag" python3 -m eagle3_train.evaluation.eval ++draft="$po/$fw/export" ++target="$target" \
    ++engine="$engine" ++k=5 ++dtype=float32 ++batch_size=$batch ++prompts="$prompts" \
    ++out="$po/$fw/eval_$tag" ++progress=false "${size[@]}"
}

run_ours() {  # run_ours NAME N STEPS EPOCHS [MINUTES] [OVERRIDE...]: the smollm2 recipe's training on the first N
  # conversations (MINUTES '': no budget; OVERRIDEs: more eagle3-run overrides)
  local name=$1 n=$2 steps=$3 epochs=$4 data; data=$(subset "$n")
  local extra=(++train.train.max_steps="$steps" ++train.train.epochs="$epochs" ++train.train.eval_every=100000)
  [ -n "${5:-}" ] && extra+=(++train.train.max_minutes="$5")
  extra+=("${@:6}")
  [ "${CPU:-0}" = 1 ] && extra+=(++train.train.compile=false ++train.train.max_tokens_per_batch=2048 ++train.model.intermediate_size=128 ++train.train.log_every=2)
  mkdir -p "$po/$name"
  phase "$name" prepare python3 -m eagle3_train.run recipe=smollm2 out="$po/$name/run" data="$data" until=prepare \
    target="${TARGET:-embedded}"
  phase "$name" train python3 -m eagle3_train.run recipe=smollm2 out="$po/$name/run" data="$data" until=train \
    target="${TARGET:-embedded}" "${extra[@]}"
  phase "$name" export python3 -m eagle3_train.serving.export ++run="$po/$name/run/train" ++out="$po/$name/export"
}

run_modelopt() {  # run_modelopt NAME N STEPS [noexport]: ModelOpt's example launcher, its EAGLE-3 recipe and defaults
  local name=$1 n=$2 steps=$3 data target; data=$(subset "$n"); target=$(target_dir)
  local site=/tmp/mosite ex=$peers/modelopt_ex args=()
  mkdir -p "$po/$name"
  [ -d "$site/modelopt" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$peers"/whl/nvidia_modelopt-*.whl "$peers"/whl/pulp-*.whl
  # its padding: every sample is padded to training_seq_len (2048 by default); 512 holds the set's replies
  args=(model.model_name_or_path="$target" data.data_path="$data" training.output_dir="$po/$name/out"
        training.training_seq_len=512 training.max_steps="$steps" training.logging_steps=50 ${MODELOPT_EXTRA:-})
  local launch=(python3 -m accelerate.commands.launch --mixed_precision bf16 main.py)
  if [ "${CPU:-0}" = 1 ]; then
    args+=(training.use_cpu=true training.bf16=false training.tf32=false eagle.eagle_use_torch_compile=false
           eagle.eagle_architecture_config.intermediate_size=128 eagle.eagle_architecture_config.num_attention_heads=4
           eagle.eagle_architecture_config.num_key_value_heads=2 eagle.eagle_architecture_config.head_dim=16)
    launch=(python3 "$repo/benchmarks/peers_modelopt_cpu.py")
  fi
  (cd "$ex" && export PYTHONPATH=$site:$ex:${PYTHONPATH:-} && phase "$name" train "${launch[@]}" \
    --config "$site/modelopt_recipes/general/speculative_decoding/eagle3.yaml" "${args[@]}" 2>&1 \
    | grep --line-buffered -v "^W[0-9]\{4\} " | tee "$po/$name/train.log") || return 1  # (less torch.compile's fallback warnings)
  [ "${4:-}" = noexport ] && return 0
  (cd "$ex" && export PYTHONPATH=$site:$ex:${PYTHONPATH:-} && phase "$name" export python3 scripts/export_hf_checkpoint.py \
    --model_path "$po/$name/out" --export_path "$po/$name/export")
}

wait_http() {  # wait_http URL SECONDS PID: until URL answers, or fail (at once when the server PID has ended)
  local end=$((SECONDS + $2))
  until python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; do
    [ $SECONDS -lt $end ] || { echo "peers_gpu: $1 did not answer in $2 s" >&2; return 1; }
    kill -0 "$3" 2>/dev/null || { echo "peers_gpu: the server for $1 ended before it answered" >&2; return 1; }
    sleep 2
  done
}

spec_data() {  # spec_data NAME N: speculators' data: vLLM renders the first N chats and writes their states
  local name=$1 n=$2 data target; data=$(subset "$n"); target=$(target_dir)
  local site=/tmp/specsite port=8765 hs=$po/$name/hs nl
  nl=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$target/config.json")
  mkdir -p "$po/$name" "$hs"
  [ -d "$site/speculators" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$peers"/whl/speculators-*.whl "$peers"/whl/hs_connectors-*.whl
  as_conversations "$data" "$po/$name/conversations.jsonl"
  # vLLM writes the states of HF indices 2, N//2, N-3 and the pre-norm final state N (its own launcher's ids),
  # the command this project's served dump uses
  local vllm
  if [ "${CPU:-0}" = 1 ]; then
    vllm="python3 $repo/benchmarks/peers_vllm_standin.py $target $port $hs"
  else
    vllm=$(python3 -c "import sys; from eagle3_train.engines.vllm import launch; print(launch(sys.argv[1], [2, $nl // 2, $nl - 3, $nl], 'bfloat16', $port, sys.argv[2]))" "$target" "$hs")
    # shellcheck source=benchmarks/staging/engine_env.sh
    source "$repo/benchmarks/staging/engine_env.sh"
    # --enforce-eager: no compile or CUDA-graph capture at start (2 min 45 s cold on the H200); the states are the same
    vllm="${vllm_env[*]} $vllm --gpu-memory-utilization 0.5 --max-model-len 4096 --enforce-eager"
  fi
  setsid nohup bash -c "$vllm" > "$po/$name/vllm.log" 2>&1 < /dev/null &
  local pid=$!
  wait_http "http://127.0.0.1:$port/v1/models" 600 "$pid" || { tail -n 40 "$po/$name/vllm.log"; return 1; }
  local spec=(env "PYTHONPATH=$site:${VSITE:-/tmp/vsite}:${PYTHONPATH:-}" python3 -m speculators)
  phase "$name" data "${spec[@]}" prepare-data --model "$target" --data "$po/$name/conversations.jsonl" \
    --render-endpoint "http://127.0.0.1:$port" --output "$po/$name/data" --seq-length 4096 --max-samples "$n" \
    --no-skip-token-freq
  phase "$name" states "${spec[@]}" generate-offline-data --preprocessed-data "$po/$name/data" \
    --endpoint "http://127.0.0.1:$port/v1" --concurrency "$([ "${CPU:-0}" = 1 ] && echo 2 || echo 32)"
  kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
}

spec_train() {  # spec_train NAME DATA_NAME STEPS|epoch: speculators' trainer, defaults, one epoch at most STEPS steps
  local name=$1 from=$2 steps=$3 target site=/tmp/specsite; target=$(target_dir)
  mkdir -p "$po/$name"
  local train=(env "PYTHONPATH=$site:${VSITE:-/tmp/vsite}:${PYTHONPATH:-}" python3 -m speculators train) extra=()
  [ "$steps" = epoch ] || extra+=(--max-steps "$steps")  # (its schedule then spans STEPS, else the epoch)
  if [ "${CPU:-0}" = 1 ]; then
    train=(env "PYTHONPATH=$site:${PYTHONPATH:-}" python3 "$repo/benchmarks/peers_speculators_cpu.py")
    extra+=(--draft-attn-impl sdpa --loss-implementation eager --total-seq-len 1024 --num-workers 0)
  fi
  # SPECULATORS_EXTRA: more of its flags, e.g. --loss-implementation eager
  # shellcheck disable=SC2206  # flags: a space-separated list
  extra+=(${SPECULATORS_EXTRA:-})
  # --epochs 1: with more, a run stopped by --max-steps still runs a step, a validation and a save per epoch left
  train+=(--verifier-name-or-path "$target" --data-path "$po/$from/data" --save-path "$po/$name/ckpt"
          --on-missing raise --epochs 1 "${extra[@]}")
  local log="$po/$name/train.log"
  local compile_failed='BackendCompilerFailed|InductorError|torch\._(dynamo|inductor)\.exc|TORCHDYNAMO_VERBOSE|^from user code:'
  until phase "$name" train "${train[@]}" 2>&1 | tee "$log"; do
    if grep -q "losses/fused.py" "$log" && [[ " ${train[*]} " != *" --loss-implementation eager "* ]]; then
      # its default loss (fused Triton kernels inside its torch.compile'd forward) does not compile on torch
      # 2.11: dynamo asserts on the autotuner configs its forward and backward kernels share. Its eager loss then.
      echo "peers_gpu: speculators' fused loss did not compile; again with --loss-implementation eager" | tee -a "$po/session.txt"
      mv "$log" "$po/$name/train_fused_failed.log"
      train+=(--loss-implementation eager)
    elif grep -qE "$compile_failed" "$log" && [[ " ${train[*]} " != *" TORCHDYNAMO_DISABLE=1 "* ]]; then
      # its forward failed to compile (not in its loss; an error merely raised through the compiled frame, such
      # as an OOM, is no compile failure and is not retried): once more with that forward eager
      echo "peers_gpu: speculators' compiled forward failed in torch's compiler; again with TORCHDYNAMO_DISABLE=1" | tee -a "$po/session.txt"
      mv "$log" "$po/$name/train_compile_failed.log"
      train=(env TORCHDYNAMO_DISABLE=1 "${train[@]}")
    else
      return 1
    fi
    rm -rf "$po/$name/ckpt"
  done
  ln -sfn "$po/$name/ckpt/0" "$po/$name/export"
}

run_speculators() {  # run_speculators NAME N STEPS
  spec_data "$1" "$2"
  spec_train "$1" "$1" "$3"
}

sf_prepare() {  # sf_prepare NAME N: SpecForge's draft config and its features of the first N chats, from an HF forward
  # (its only capture backend is SGLang 0.5.14, which does not import on the image: "SpecForge training on
  # HF-captured features", notes/peer_training.md Plan B); its own tokenization and masks, template lfm (ChatML)
  local name=$1 n=$2 data target site=/tmp/sfsite; data=$(subset "$n"); target=$(target_dir)
  mkdir -p "$po/$name"
  [ -d "$site/specforge" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$peers"/whl/specforge-*.whl "$peers"/whl/yunchang-*.whl
  as_conversations "$data" "$po/$name/conversations.jsonl"
  local sf=(env "PYTHONPATH=$site:${PYTHONPATH:-}" python3 "$repo/benchmarks/peers_specforge.py")
  "${sf[@]}" config "$target" "$po/$name/draft.json"
  "${sf[@]}" tied "$target" "$po/$name/target"  # (its target head reads a weight map; the checkpoint is one file)
  phase "$name" states "${sf[@]}" features "$po/$name/target" "$po/$name/conversations.jsonl" "$po/$name/feats" lfm 2048
}

sf_train() {  # sf_train NAME STEPS: SpecForge's trainer, its defaults (batch 1, ttt 7, lr 1e-4 cosine), one epoch at most STEPS, export
  local name=$1 steps=$2 site=/tmp/sfsite
  local train=(python3 -m specforge.cli) backend=() env_=(env "PYTHONPATH=$site:${PYTHONPATH:-}")
  if [ "${CPU:-0}" = 1 ]; then
    train=(python3 "$repo/benchmarks/peers_specforge_cpu.py")
    backend=(training.attention_backend=sdpa data.dataloader_num_workers=0 training.log_interval=2)
    env_+=(TORCHDYNAMO_DISABLE=1)
  fi
  cat > "$po/$name/run.yaml" <<YAML
model:
  target_model_path: $po/$name/target
  draft_model_config: $po/$name/draft.json
  lm_head_key: model.embed_tokens.weight
data:
  hidden_states_path: $po/$name/feats
  chat_template: lfm
  cache_dir: $po/$name/sf_cache
training:
  strategy: eagle3
  num_epochs: 1
  max_steps: $steps
run_id: $name
output_dir: $po/$name/out
YAML
  phase "$name" train "${env_[@]}" "${train[@]}" train -c "$po/$name/run.yaml" "${backend[@]}" 2>&1 \
    | tee "$po/$name/train.log" || return 1
  phase "$name" export "${env_[@]}" "${train[@]}" export --to sglang --checkpoint "$po/$name/out/$name-latest" \
    --draft-config "$po/$name/draft.json" --output-dir "$po/$name/export"
}

run_specforge() {  # run_specforge NAME N STEPS
  sf_prepare "$1" "$2"
  sf_train "$1" "$3"
}

steady_rate() {  # steady_rate LOG STEPS|epoch: steps/s of LOG's training bar after its first tenth (start-up and compile left out)
  # the bar: HF Trainer's counts STEPS; speculators' reads 'Epoch N  x% ━━ done/total [h:mm:ss' (total: the epoch's)
  python3 -c "
import re, sys
sys.path.insert(0, sys.argv[3])
from peers_results import speculators_steady, speculators_training
text, which = open(sys.argv[1]).read(), sys.argv[2]
step_ms = speculators_steady(text, 'step_ms') if which == 'epoch' else None
if step_ms is not None:  # speculators logs each step's time (its log file holds only each epoch's final bar)
    print(round(1000 / step_ms, 3))
    sys.exit()
text = speculators_training(text)
lead = r'Epoch \d+\s+\d+%\s+\S+\s+' if which == 'epoch' else ''
bars = [(int(d), int(n), 3600 * int(h or 0) + 60 * int(m) + int(s))
        for d, n, h, m, s in re.findall(lead + r'(\d+)/(\d+)\s*\[\s*(?:(\d+):)?(\d+):(\d\d)', text)]
if which != 'epoch':
    bars = [b for b in bars if b[1] == int(which)]  # its bar, not the data loading's or the save's
run = [bars[-1]]  # back from the last while it counts up
for b in reversed(bars[:-1]):
    if b[1] != run[-1][1] or b[0] > run[-1][0] or b[2] > run[-1][2]:
        break
    run.append(b)
run.reverse()
last = run[-1]
first = next(b for b in run if b[0] >= max(1, last[0] // 10))  # (the tenth of the steps run: a bar may stop early)
if last[2] <= first[2]:  # one reading left: the whole bar's rate, start-up included
    print('peers_gpu: one reading of the bar: its whole rate', file=sys.stderr)
    first = (0, 0, 0)
print(round((last[0] - first[0]) / max(1, last[2] - first[2]), 3))" "$1" "$2" "$repo/benchmarks"
}

loop_minutes() {  # loop_minutes LOG: minutes of a peer's training loop, as its own log says
  # (HF Trainer's train_runtime for ModelOpt; speculators' epoch bars' elapsed times, its validation's left out; SpecForge's
  # last logged step times the median of its logged optimizer-step times)
  python3 -c "
import re, statistics, sys
sys.path.insert(0, sys.argv[2])
from peers_results import speculators_loop_s
text = open(sys.argv[1]).read()
hf = re.findall(r\"'train_runtime': '?([0-9.]+)\", text)
sf = re.findall(r\"step (\d+): \{.*'perf/optimizer_step_time_s': ([0-9.e-]+)\", text)
if hf:
    secs = float(hf[-1])
elif (loop := speculators_loop_s(text)) is not None:
    secs = loop
else:
    secs = int(sf[-1][0]) * statistics.median(float(t) for _, t in sf)
print(round(secs / 60, 3))" "$1" "$repo/benchmarks"
}

speculators_run() {  # speculators_run BUDGET|epoch N: its data and states, its training (BUDGET seconds of
  # steps at the rate of a probe, or one whole epoch), then evaluated (vLLM's rule) and served
  local budget=$1 n=$2 probe=40 rate steps=epoch
  [ "${CPU:-0}" = 1 ] && probe=3
  spec_data speculators "$n"
  if [ "$budget" != epoch ]; then
    spec_train speculators_probe speculators "$probe" > "$po/speculators_probe.log" 2>&1 || { tail -n 40 "$po/speculators_probe.log"; return 1; }
    rate=$(steady_rate "$po/speculators_probe.log" epoch)
    steps=$(python3 -c "print(max(4, int($budget * $rate)))")
    echo "peers_gpu: speculators ran $rate steps/s in its probe: $steps steps (one epoch of $n conversations at most)" | tee -a "$po/session.txt"
  fi
  spec_train speculators speculators "$steps"
  held_out speculators
}

run_session_speculators() {  # BUDGET|epoch [N]: speculators vs ours, as session_modelopt
  # in the order that keeps the verdict if the call's time runs out: speculators trained, evaluated and
  # served; ours at its minutes; MT-bench; ours on the same conversations for one epoch last.
  # BUDGET=epoch: no probe, speculators trains one whole epoch of the N conversations
  local budget=${1:-300} n=${2:-32768}
  speculators_run "$budget" "$n"
  # ours for speculators' training-loop minutes over the whole set
  ours_same_minutes speculators speculators
  held_out ours_same_minutes
  for fw in speculators ours_same_minutes; do go_on evaluate "$fw" mtbench vllm; done
  # ours on speculators' conversations, one epoch
  run_ours ours_same_data "$n" 1000000 1
  held_out ours_same_data
  go_on evaluate ours_same_data mtbench vllm
}

run_session_pair() {  # epoch|BUDGET [N] [MODELOPT_STEPS_PER_S]: speculators, ModelOpt and ours at the same minutes
  # speculators as in session_speculators; ModelOpt then trains for speculators' loop minutes at its steady
  # rate measured in an earlier session (1.46 steps/s, peers_modelopt_h200: no probe), so that one run of ours
  # (ours_same_minutes) is the equal-minutes reference for both; every draft evaluated (vLLM's rule) and served.
  # In the order that keeps the verdict if the device time runs out: speculators; ours at its minutes; ours on
  # its conversations; ModelOpt (far from out of its 1,000-step warmup at these minutes); MT-bench last
  local budget=${1:-epoch} n=${2:-8192} mo_rate=${3:-1.46} secs mo_steps
  speculators_run "$budget" "$n"
  ours_same_minutes speculators speculators
  held_out ours_same_minutes
  run_ours ours_same_data "$n" 1000000 1
  held_out ours_same_data
  # the recipe sets train.min_steps=160 (8,192-token batches gave 167 steps, tau 1.51: peers_pair2_h200); the CPU
  # study at 1/16 of this size (peers_short_run_cpu.json) still rose at 400 steps
  run_ours ours_same_data_more_steps "$n" 1000000 1 "" ++train.train.min_steps=400
  held_out ours_same_data_more_steps
  secs=$(python3 -c "print(round(60 * $(loop_minutes "$po/speculators/train.log"), 1))")
  mo_steps=$(python3 -c "print(max(8, int($secs * $mo_rate)))")
  echo "peers_gpu: ModelOpt for speculators' $secs s of loop at $mo_rate steps/s: $mo_steps steps, $mo_steps conversations" | tee -a "$po/session.txt"
  if run_modelopt modelopt "$mo_steps" "$mo_steps"; then
    held_out modelopt
  fi
  for fw in speculators ours_same_minutes ours_same_data ours_same_data_more_steps modelopt; do
    go_on evaluate "$fw" mtbench vllm
  done
  go_on evaluate modelopt heldout vllm as_trained
}

run_session_specforge() {  # [N]: SpecForge (its trainer on HF-captured features, batch 1: one epoch of N conversations
  # is N steps) vs ours at its minutes
  local n=${1:-1500}
  run_specforge specforge "$n" "$n"
  held_out specforge
  ours_same_minutes specforge SpecForge
  held_out ours_same_minutes
  for fw in specforge ours_same_minutes; do go_on evaluate "$fw" mtbench vllm; done
}

served() {  # served FW: vLLM serving the target with $po/FW/export; eagle3-served-acceptance on the held-out prompts
  local fw=$1 target port=8766 spec vllm=(vllm); target=$(target_dir)
  # on a CPU machine the stand-in of tests/standin_engines.py, from the same command line: it runs the draft
  # as eagle3-eval's decoder computes it for vLLM and counts acceptance as vLLM's /metrics does
  local dtype=bfloat16  # (on CPU the stand-in in eval's float32, so that its figures are eval's)
  [ "${CPU:-0}" = 1 ] && vllm=(python3 "$repo/tests/standin_engines.py" vllm) dtype=float32
  spec=$(python3 -c "import json,sys; print(json.dumps({'method': 'eagle3', 'model': sys.argv[1], 'num_speculative_tokens': 5}))" "$po/$fw/export")
  # shellcheck source=benchmarks/staging/engine_env.sh
  source "$repo/benchmarks/staging/engine_env.sh"
  # --enforce-eager: the start without compile and graph capture (minutes saved per draft); what it accepts is the same
  local more=() pid rc=0 up=0
  while :; do
    setsid nohup "${vllm_env[@]}" "${vllm[@]}" serve "$target" --port $port --dtype "$dtype" --max-model-len 4096 \
      --gpu-memory-utilization 0.5 --enforce-eager "${more[@]}" --speculative-config "$spec" > "$po/$fw/vllm_serve.log" 2>&1 < /dev/null &
    pid=$!
    wait_http "http://127.0.0.1:$port/health" 600 "$pid" && up=1 && break
    # vLLM 0.26's FA3 plans the draft's attention with the target's shape (eagle3-check warns): once with FA2
    if [ ${#more[@]} = 0 ] && grep -q "scheduler_metadata must have shape" "$po/$fw/vllm_serve.log"; then
      mv "$po/$fw/vllm_serve.log" "$po/$fw/vllm_serve_fa3.log"
      more=(--attention-config.flash_attn_version=2)
      echo "peers_gpu: vLLM's FA3 refused $fw's attention shape at start; again with ${more[*]}" | tee -a "$po/session.txt"
      kill -- -"$pid" 2>/dev/null || true
      sleep 5
      continue
    fi
    break
  done
  if [ "$up" = 1 ]; then
    phase "$fw" served python3 -m eagle3_train.evaluation.served_acceptance ++server="http://127.0.0.1:$port" \
      ++engine=vllm ++prompts="$repo/data_prep/prompts/heldout.jsonl" ++max_new_tokens=128 ++draft="$po/$fw/export" \
      ++out="$po/$fw/served" ++wait_for_server_s=30 || rc=$?
  else
    tail -n 30 "$po/$fw/vllm_serve.log"
    rc=1
  fi
  kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  sleep 5
  return "$rc"
}

ours_same_minutes() {  # ours_same_minutes FW NAME: ours over the whole set for FW's training-loop minutes
  # (its own log's: HF Trainer's train_runtime, speculators' bar), as train.max_minutes
  local fw=$1 secs all minutes
  secs=$(train_seconds "$fw")
  all=$(zcat "$peers/data/$data_set" | wc -l)
  minutes=$(loop_minutes "$po/$fw/train.log")
  [ "${CPU:-0}" = 1 ] && all=64
  echo "peers_gpu: $2 trained $secs s ($minutes minutes of loop): ours for $minutes minutes over $all conversations" | tee -a "$po/session.txt"
  run_ours ours_same_minutes "$all" 10000000 6 "$minutes"
}

train_seconds() {  # train_seconds FW: the seconds of FW's train phase
  python3 -c "import json,sys; print([r['seconds'] for r in map(json.loads, open(sys.argv[1])) if r['fw']==sys.argv[2] and r['phase']=='train'][-1])" "$po/phases.jsonl" "$1"
}

run_session_modelopt() {  # BUDGET: ModelOpt vs ours, same data and epochs, and same minutes
  local budget=${1:-300} probe=100 rate steps
  [ "${CPU:-0}" = 1 ] && probe=4
  # 1. ModelOpt's rate from a short run, then BUDGET seconds of steps over as many conversations (batch 1, one epoch)
  if ! run_modelopt modelopt_probe "$probe" "$probe" noexport > "$po/modelopt_probe.log" 2>&1; then
    # its default compiles the draft with torch.compile: without it, once, if that is what failed
    tail -n 30 "$po/modelopt_probe.log"
    export MODELOPT_EXTRA=eagle.eagle_use_torch_compile=false
    echo "peers_gpu: ModelOpt's probe failed; again with $MODELOPT_EXTRA" | tee -a "$po/session.txt"
    rm -rf "$po/modelopt_probe"
    run_modelopt modelopt_probe "$probe" "$probe" noexport > "$po/modelopt_probe.log" 2>&1 || { tail -n 40 "$po/modelopt_probe.log"; return 1; }
  fi
  rate=$(steady_rate "$po/modelopt_probe.log" "$probe")
  steps=$(python3 -c "print(max(8, int($budget * $rate)))")
  echo "peers_gpu: ModelOpt ran $rate steps/s in its probe: $steps steps, $steps conversations" | tee -a "$po/session.txt"
  run_modelopt modelopt "$steps" "$steps"
  go_on evaluate modelopt heldout sglang
  # 2. ours on the same conversations, one epoch (the same data and epochs)
  run_ours ours_same_data "$steps" 1000000 1
  go_on evaluate ours_same_data heldout sglang
  # 3. ours for ModelOpt's training-loop minutes over the whole set (the same minutes)
  ours_same_minutes modelopt ModelOpt
  go_on evaluate ours_same_minutes heldout sglang
  # ModelOpt as it trained (its export is served otherwise: notes/peer_forward.md), then MT-bench
  go_on evaluate modelopt heldout sglang as_trained
  for fw in modelopt ours_same_data ours_same_minutes; do go_on evaluate "$fw" mtbench sglang; done
}

pack_poll() {  # pack_poll DEST: what exists so far, as DEST/poll.tgz (one archive: a call brings back at most 8 files)
  # (a file that goes between the test and the copy, e.g. a log a retry renames, is left out, not fatal)
  local dest=$1 pack rel f d
  pack=$(mktemp -d)
  for f in log phases.jsonl smi.csv rc session.txt modelopt_probe.log speculators_probe.log; do
    [ -f "$po/$f" ] && { cp "$po/$f" "$pack/" || true; }
  done
  for f in "$po"/*/eval_*/report.json "$po"/*/served/report.json "$po"/*/export/config.json \
           "$po"/*/run/train/metrics.jsonl "$po"/*/run/prepared/manifest.json "$po"/*/run/train/best.json \
           "$po"/*/train.log; do
    rel=${f#"$po"/}
    [ -f "$f" ] && { cp "$f" "$pack/${rel//\//_}" || true; }
  done
  for f in "$po"/*/vllm*.log; do  # the engines' logs: their ends
    rel=${f#"$po"/}
    [ -f "$f" ] && { tail -n 150 "$f" > "$pack/${rel//\//_}" || true; }
  done
  for d in "$po"/*/export; do
    [ -d "$d" ] && echo "$(basename "$(dirname "$d")") $(stat -L -c %s "$d"/*.safetensors 2>/dev/null | awk '{s += $1} END {print s + 0}')"
  done > "$pack/draft_bytes.txt"
  mkdir -p "$dest" && tar czf "$dest/.poll.tgz" -C "$pack" . && mv "$dest/.poll.tgz" "$dest/poll.tgz" && rm -rf "$pack"
}

case $cmd in
pack)
  ex=${2:?ModelOpt examples/speculative_decoding directory}; mt=${3:?MT-bench question.jsonl}
  mkdir -p "$repo/.peers/whl" "$repo/.peers/modelopt_ex/scripts" "$repo/.peers/data"
  python3 -m pip download -q --no-deps -d "$repo/.peers/whl" nvidia-modelopt==0.47.0 pulp==3.3.2 \
    speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 yunchang==0.6.4
  cp "$ex"/{main.py,eagle_utils.py,fsdp2_buffer_patch.py} "$repo/.peers/modelopt_ex/"
  cp "$ex"/scripts/{ar_validate.py,export_hf_checkpoint.py,calibrate_draft_vocab.py} "$repo/.peers/modelopt_ex/scripts/"
  cp "$mt" "$repo/.peers/data/mt_bench_question.jsonl"
  [ -f "$repo/.peers/data/$data_set" ] || echo "peers_gpu: .peers/data/$data_set missing: save it from a GPU run" >&2
  du -sh "$repo/.peers"/*
  ;;
stage)
  rm -rf "$peers" && mkdir -p "$peers" && cp -r "$repo/.peers/." "$peers/"
  rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r "$repo/." /tmp/repo/ && rm -rf /tmp/repo/.peers
  echo "peers_gpu: staged $(du -sh "$peers" | cut -f1) in $peers, the repository in /tmp/repo"
  ;;
start)
  what=${2:?session name, e.g. session_modelopt}; shift 2
  rm -rf "${po:?}" && mkdir -p "$po"
  cd /tmp/repo 2>/dev/null || cd "$repo"
  if command -v nvidia-smi >/dev/null; then
    setsid nohup nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 2 > "$po/smi.csv" 2>&1 < /dev/null &
    echo $! > "$po/smi.pid"
  fi
  setsid nohup bash -c "bash benchmarks/peers_gpu.sh job $what $*; echo \$? > $po/rc" > "$po/log" 2>&1 < /dev/null &
  echo "started: $what $*"
  ;;
job)
  what=${2:?what}; shift 2
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
  "run_$what" "$@"
  ;;
poll)
  # what exists so far, packed as one archive every minute (and at the end): should the call be cut
  # short by the device's limit, the last minute's archive still comes back
  secs=${2:?seconds}; dest=${3:?destination}
  end=$((SECONDS + secs)) next=$SECONDS
  while [ ! -f "$po/rc" ] && [ $SECONDS -lt $end ]; do
    if [ $SECONDS -ge $next ]; then pack_poll "$dest"; next=$((SECONDS + 60)); fi
    sleep 5
  done
  pack_poll "$dest"
  grep "peers_gpu:\|tau \|Error\|error" "$po/log" | tail -n 20 || true  # (nothing matched yet: not a failure)
  tail -n 4 "$po/log"
  if [ -f "$po/rc" ]; then
    [ -f "$po/smi.pid" ] && kill "$(cat "$po/smi.pid")" 2>/dev/null || true
    echo "ended: rc=$(cat "$po/rc")"
  else
    echo "running"
  fi
  ;;
*) echo "usage: peers_gpu.sh pack|stage|start|poll ..." >&2; exit 2 ;;
esac
