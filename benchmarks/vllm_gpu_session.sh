#!/usr/bin/env bash
# Issue #19 on one H200 with vLLM 0.26.0, as ONE background job (run from the repository root after
# staging; every step under `timeout`, a failed step never stops the next; $W/results.json is
# rewritten after each step, and $W/bundle/ holds what a polling call copies back):
#
#   draft  (unless DRAFT=<export dir> is carried): prepare TRAIN_N shipped synthesized conversations,
#          dump (hf, bf16), standardize, train ~2 min (the recipe's options, ttt = K), export
#          engines=[vllm]; eagle3-check of it
#   b      eagle3-eval of the draft on the held-out prompts (k=K, greedy, fp32 as
#          benchmarks/smollm2_synth.sh calls it, and bf16, the served dtype), then the target served
#          by vLLM with the draft (--speculative-config method eagle3, K tokens) and
#          eagle3-served-acceptance on the same prompts (NEW_TOKENS per turn): vLLM's own counters.
#          Nothing else runs on the GPU while vLLM starts: its memory profiling fails when another
#          process frees GPU memory meanwhile (vllm/v1/worker/gpu_worker.py)
#   c      the same with a copy of the export whose aux-layer ids (vLLM's top-level ones and SGLang's
#          nested ones) are shifted by SHIFT layers: vLLM must lose what eval loses
#   a      prepare N conversations, dump them with backend=hf (bf16) and with backend=vllm
#          (launch/dump_served.sh: vLLM with extract_hidden_states), compare the two dumps
#          (benchmarks/compare_dumps.py); last, as it needs no draft
#
# Estimated (not measured): ~15 minutes with a draft trained here (~11 with DRAFT carried), of which
# vLLM start-ups are ~1.5 minutes each (3 of them). Results: $W/results.json (each step's exit status, seconds and
# figures; "summary" puts vLLM's mean acceptance length and per-position rates beside eval's tau for
# the export and the shifted one, and the dump comparison), $W/log, logs under $W/*.log.
#
# Variables (default): W (/tmp/w19), DRAFT (none: train one), TARGET (embedded), N (200), TRAIN_N
# (2048), K (5), NEW_TOKENS (128), SHIFT (1), PORT (8000), EPOCHS (20), TRAIN_S (300: the training
# step's time limit; checkpoints every 50 steps, so a cut run still exports its best), DRAFT_VOCAB
# (8192), VLLM_ARGS (--enforce-eager --gpu-memory-utilization 0.5: skips torch.compile and CUDA-graph
# capture at start-up), DUMP_EXTRA / TRAIN_EXTRA (more eagle3-dump / eagle3-train overrides), VSITE
# (/tmp/vsite) and SITE (/tmp/site): where benchmarks/staging/stage_vllm.sh and benchmarks/staging/gpu_stage.sh installed;
# PYTHONPATH, when set, replaces $VSITE:$SITE:<repo>.
#
# The device calls (kind nvidia-h200; one after the other with no pause, since the machine goes back
# after 30 s idle and /tmp with it; each call carries at most 64 MiB with the working tree):
#   1. carry [".whl", ".gguf/part-0", ".gguf/name"]  command: benchmarks/staging/gpu_stage.sh install
#   2. carry [".gguf/part-1", ".gguf/name"]           command: benchmarks/staging/gpu_stage.sh install
#   3. carry [".vllm/parts/1"]                        command: benchmarks/staging/stage_vllm.sh install
#   4. carry [".vllm/parts/2"]                        command: benchmarks/staging/stage_vllm.sh install
#   5. carry [".vllm/parts/3"]                        command: benchmarks/staging/stage_vllm.sh install
#      (its output ends "every requirement met" or lists what is missing; the pack side is
#      `benchmarks/staging/gpu_stage.sh pack` and `benchmarks/staging/stage_vllm.sh pack`, run here beforehand)
#   6. carry ["runs/<x>/export"] (a trained export, ~15 MiB; or nothing: one is trained there)
#      command: W=/tmp/w19 DRAFT=runs/<x>/export setsid nohup bash benchmarks/vllm_gpu_session.sh \
#                 >/tmp/w19.out 2>&1 </dev/null & sleep 5; cat /tmp/w19.out /tmp/w19/log
#   7. polling, as often as needed (timeout_s 600; each returns when the job is done or after 9.5 min):
#      timeout 570 bash -c 'until [ -f /tmp/w19/done ]; do sleep 10; done'; cp /tmp/w19/bundle/* "$OUT"/; tail -5 /tmp/w19/log
#      -> results.json, log, logs.tgz (the step logs, the reports, the vLLM logs)
#
# On a CPU machine the same script runs against the stand-in vLLM of tests/standin_engines.py (a
# `vllm` on PATH that runs it) and a target directory, to catch mistakes before GPU time is spent:
#   TARGET=<tiny target dir> N=8 TRAIN_N=16 NEW_TOKENS=16 TRAIN_EXTRA=train.max_steps=6 \
#     DUMP_EXTRA='capture.aux_indices=[0,1,2]' PYTHONPATH=$PWD PATH=<dir with vllm -> standin>:$PATH bash ...
set -uo pipefail
W=${W:-/tmp/w19}
REPO=$(pwd)
VSITE=${VSITE:-/tmp/vsite}
SITE=${SITE:-/tmp/site}
export PYTHONPATH=${PYTHONPATH:-$VSITE:$SITE:$REPO}
export PATH=$VSITE/bin:$PATH EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache} PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
TARGET=${TARGET:-embedded}
N=${N:-200}
TRAIN_N=${TRAIN_N:-2048}
K=${K:-5}
NEW_TOKENS=${NEW_TOKENS:-128}
SHIFT=${SHIFT:-1}
PORT=${PORT:-8000}
VLLM_ARGS=${VLLM_ARGS:---enforce-eager --gpu-memory-utilization 0.5}
DRAFT=${DRAFT:-}
py=python3
PROMPTS=data_prep/prompts
HELDOUT=$PROMPTS/heldout.jsonl
URL=http://127.0.0.1:$PORT
mkdir -p "$W"
rm -f "$W/done"
exec >>"$W/log" 2>&1
SERVER=

record() {  # record <step> <exit status> <seconds> [<JSON file of its figures>]: into $W/results.json, then bundle
  $py - "$W/results.json" "$@" <<'PY'
import json, os, sys
path, step, rc, seconds, *src = sys.argv[1:]
res = json.load(open(path)) if os.path.exists(path) else {"issue": 19, "steps": {}}
entry = {"rc": int(rc), "seconds": int(seconds)}
if src and os.path.isfile(src[0]):
    data = json.load(open(src[0]))
    entry["result"] = {k: v for k, v in data.items() if k not in ("config", "request", "definitions")}
res["steps"][step] = entry
steps = {k: v.get("result") or {} for k, v in res["steps"].items()}
summary = {}
for which in ("export", "shifted"):
    s, e32, e16 = steps.get(f"served_{which}", {}), steps.get(f"eval_{which}_fp32", {}), steps.get(f"eval_{which}_bf16", {})
    summary[which] = {
        "vllm_mean_acceptance_length": s.get("mean_acceptance_length"),
        "vllm_acceptance_per_position": s.get("acceptance_per_position"),
        "vllm_conditional_acceptance_per_position": s.get("conditional_acceptance_per_position"),
        "vllm_drafts": s.get("drafts"), "vllm_tokens": s.get("completion_tokens"), "vllm_warnings": s.get("warnings"),
        "eval_fp32_tau": e32.get("tau"), "eval_fp32_acceptance_per_position": e32.get("acceptance_per_position"),
        "eval_fp32_lossless": e32.get("lossless"), "eval_bf16_tau": e16.get("tau"),
        "eval_bf16_acceptance_per_position": e16.get("acceptance_per_position"), "eval_bf16_lossless": e16.get("lossless"),
        "captured_hf_indices": e32.get("captured_hf_indices"),
    }
summary["dump_compare"] = steps.get("compare") or None
res["summary"] = summary
json.dump(res, open(path + ".tmp", "w"), indent=2)
os.replace(path + ".tmp", path)
PY
  mkdir -p "$W/bundle"
  cp "$W/results.json" "$W/log" "$W/bundle/" 2>/dev/null
  (cd "$W" && tar -czf bundle/.logs.tgz --ignore-failed-read -- *.log ./*/*.log ./*/report.json ./*/outputs.jsonl \
    ./*/manifest.json compare.json 2>/dev/null; mv bundle/.logs.tgz bundle/logs.tgz)
}

note() {  # note <key> <value>: a top-level entry of $W/results.json
  $py -c 'import json, os, sys
p, k, v = sys.argv[1:]
r = json.load(open(p)) if os.path.exists(p) else {"issue": 19, "steps": {}}
r[k] = v
json.dump(r, open(p + ".tmp", "w"), indent=2)
os.replace(p + ".tmp", p)' "$W/results.json" "$1" "$2"
}

step() {  # step <name> <seconds> <command...>: under a time limit, output to $W/<name>.log; RESULT=<json> keeps its figures
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local shown="$*"
  echo "== $(date +%T) $name: ${shown:0:400}"
  # timeout leads a process group of its own: whatever the step leaves running is ended with it
  timeout -k 30 "$limit" "$@" >"$W/$name.log" 2>&1 </dev/null &
  local pid=$!
  wait "$pid"
  rc=$?
  kill -TERM -- -"$pid" 2>/dev/null && sleep 3 && kill -KILL -- -"$pid" 2>/dev/null
  echo "== $(date +%T) $name: exit $rc after $((SECONDS - t0)) s"
  record "$name" "$rc" "$((SECONDS - t0))" "${RESULT:-}"
  return "$rc"
}

serve() {  # serve <name> <draft dir>: vLLM serving the target with the draft, in the background ($SERVER)
  local spec
  spec=$($py -c 'import json, sys; print(json.dumps({"method": "eagle3", "model": sys.argv[1], "num_speculative_tokens": int(sys.argv[2])}))' \
    "$(realpath "$2")" "$K")
  echo "== $(date +%T) $1: vllm serve $TDIR --port $PORT --dtype bfloat16 --speculative-config '$spec' $VLLM_ARGS"
  SERVE_T0=$SECONDS
  # shellcheck disable=SC2086  # VLLM_ARGS is a list of flags
  timeout -k 30 1800 vllm serve "$TDIR" --port "$PORT" --dtype bfloat16 --speculative-config "$spec" $VLLM_ARGS \
    >"$W/$1.log" 2>&1 </dev/null &
  SERVER=$!
}

ready() {  # ready <name> <seconds>: wait until the server answers /health; fails as soon as it exited
  local deadline=$((SECONDS + $2)) rc=0
  until $py -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$URL/health" 2>/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "== $1: the server exited before it was ready"; rc=1; break; fi
    if [ "$SECONDS" -ge "$deadline" ]; then echo "== $1: not ready within $2 s"; rc=124; break; fi
    sleep 3
  done
  echo "== $(date +%T) $1: ready=$([ $rc = 0 ] && echo yes || echo no) after $((SECONDS - SERVE_T0)) s"
  record "$1" "$rc" "$((SECONDS - SERVE_T0))"
  return $rc
}

stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM -- -"$SERVER" 2>/dev/null
  for _ in $(seq 30); do kill -0 -- -"$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=
}
trap stop_server EXIT

shifted_copy() {  # shifted_copy <export> <out>: the export with every aux-layer id moved by SHIFT layers
  rm -rf "$2" && cp -r "$1" "$2" && $py -c 'import json, sys
path, shift = sys.argv[1] + "/config.json", int(sys.argv[2])
c = json.load(open(path))
c["eagle_aux_hidden_state_layer_ids"] = [v + shift for v in c["eagle_aux_hidden_state_layer_ids"]]
nested = c.get("eagle_config") or {}
for key in ("eagle_aux_hidden_state_layer_ids", "layer_ids"):
    if key in nested:
        nested[key] = [v + shift for v in nested[key]]
json.dump(c, open(path, "w"), indent=2)
print("shifted ids:", c["eagle_aux_hidden_state_layer_ids"], nested)' "$2" "$SHIFT"
}

speculate() {  # speculate <which> <draft dir>: step b (which=export) or c (which=shifted)
  local which=$1 draft=$2
  for dtype in fp32 bf16; do
    RESULT=$W/eval_${which}_$dtype/report.json step "eval_${which}_$dtype" 600 $py -m eagle3_train.evaluation.eval draft="$draft" \
      target="$TARGET" engine=vllm prompts="$HELDOUT" k="$K" max_new_tokens="$NEW_TOKENS" \
      dtype="$([ $dtype = fp32 ] && echo float32 || echo bfloat16)" batch_size=37 out="$W/eval_${which}_$dtype"
  done
  serve "serve_$which" "$draft"
  if ready "ready_$which" 900; then
    RESULT=$W/served_$which/report.json step "served_$which" 600 $py -m eagle3_train.evaluation.served_acceptance server="$URL" \
      prompts="$HELDOUT" max_new_tokens="$NEW_TOKENS" out="$W/served_$which" wait_for_server_s=60
  fi
  stop_server
}

echo "== $(date +%T) issue #19 session in $W: TARGET=$TARGET N=$N TRAIN_N=$TRAIN_N K=$K NEW_TOKENS=$NEW_TOKENS DRAFT=${DRAFT:-<train>}"
note started "$(date -Is)"
note machine "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo none)"
note vllm "$($py -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null || echo none)"
note variables "TARGET=$TARGET N=$N TRAIN_N=$TRAIN_N K=$K NEW_TOKENS=$NEW_TOKENS SHIFT=$SHIFT VLLM_ARGS=$VLLM_ARGS"
# The directory vLLM serves: what load_target makes of TARGET (for embedded, its GGUF converted once)
TDIR=$(timeout 600 $py -c 'import sys
from eagle3_train.targets import load_target
print(load_target(sys.argv[1], cache_dir=sys.argv[2], load_model=False).local_dir)' "$TARGET" "$EAGLE3_CACHE" | tail -1)
note target_dir "$TDIR"
echo "== target directory: $TDIR"

# ---- the draft: carried, or trained here on TRAIN_N conversations ----
if [ -z "$DRAFT" ]; then
  note draft_source "trained in this session on $TRAIN_N conversations"
  step prepare_train 300 $py -m data_prep.prepare target="$TARGET" input="$PROMPTS/synth_smollm2.jsonl.gz" \
    out="$W/prepared_train" limit="$TRAIN_N" progress=false
  # shellcheck disable=SC2086  # DUMP_EXTRA is a list of overrides
  step dump_train 600 $py -m data_prep.dump target="$TARGET" data="$W/prepared_train" out="$W/dump_train" \
    dtype=bfloat16 progress=false ${DUMP_EXTRA:-}
  step standardize 300 $py -m data_prep.standardize dumps="[$W/dump_train]" out="$W/std" \
    draft_vocab_size="${DRAFT_VOCAB:-8192}" eval_fraction=0.02 progress=false
  # shellcheck disable=SC2086  # TRAIN_EXTRA is a list of overrides
  step train "${TRAIN_S:-300}" $py -m eagle3_train.training.trainer data="$W/std" target="$TARGET" out="$W/train" \
    train.ttt_length="$K" train.epochs="${EPOCHS:-20}" train.lr=2e-3 train.warmup_steps=30 \
    train.max_tokens_per_batch=16384 train.eval_every=50 train.save_every=50 train.keep_best=true train.log_every=20 \
    model.lm_head_init=target model.intermediate_size=3072 progress=false ${TRAIN_EXTRA:-}
  step export 300 $py -m eagle3_train.serving.export run="$W/train" out="$W/export" "engines=[vllm]"
  DRAFT=$W/export
else
  note draft_source "carried: $DRAFT"
fi
note draft "$DRAFT"
step check 300 $py -m eagle3_train.serving.check draft="$DRAFT" target="$TARGET" "engines=[vllm]"

# ---- b: the export served by vLLM; c: its shifted copy ----
speculate export "$DRAFT"
shifted_copy "$DRAFT" "$W/shifted" >"$W/shift.log" 2>&1
cat "$W/shift.log"
speculate shifted "$W/shifted"

# ---- a: the same prepared data dumped by transformers and by vLLM ----
step prepare 300 $py -m data_prep.prepare target="$TARGET" input="$PROMPTS/synth_smollm2.jsonl.gz" out="$W/prepared" \
  limit="$N" progress=false
# shellcheck disable=SC2086  # DUMP_EXTRA is a list of overrides
step dump_hf 600 $py -m data_prep.dump target="$TARGET" data="$W/prepared" out="$W/dump_hf" dtype=bfloat16 \
  progress=false ${DUMP_EXTRA:-}
mkdir -p "$W/dump_vllm_engine"
# shellcheck disable=SC2086  # DUMP_EXTRA is a list of overrides
step dump_vllm 900 env BACKEND=vllm CLIENTS=1 LOGDIR="$W/dump_vllm_engine" EAGLE3_DUMP="$py -m data_prep.dump" \
  ENGINE_ARGS="$VLLM_ARGS" bash launch/dump_served.sh target="$TARGET" data="$W/prepared" out="$W/dump_vllm" \
  dtype=bfloat16 server.url="$URL" client.wait_for_server_s=420 progress=false ${DUMP_EXTRA:-}
cp "$W/dump_vllm_engine/engine0.log" "$W/dump_vllm_engine.log" 2>/dev/null
RESULT=$W/compare.json step compare 600 $py -c 'import json, sys
from pathlib import Path
from eagle3_train.core.contract import read_manifest
from benchmarks.compare_dumps import compare
hf, vllm, out = map(Path, sys.argv[1:])
for d in (hf, vllm):
    read_manifest(d, "dump")  # finished dumps only
report = compare(hf, vllm)
for key, stats in report.items():
    print(f"  {key:14s} " + "  ".join(f"{k}={v:.3g}" for k, v in stats.items()))
out.write_text(json.dumps(report, indent=2))' "$W/dump_hf" "$W/dump_vllm" "$W/compare.json"

note finished "$(date -Is)"
record session 0 "$SECONDS"
echo "== $(date +%T) all done"
touch "$W/done"
