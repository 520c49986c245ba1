"""A CPU stand-in for the two vLLM endpoints speculators 0.9.0's data preparation calls, to test
benchmarks/peers_gpu.sh's speculators path on a CPU machine (never a measurement):

    python3 benchmarks/peers_vllm_standin.py MODEL_DIR PORT STATES_DIR

``/v1/chat/completions/render``: the chat template's token ids; ``/v1/completions``: what vLLM's
``extract_hidden_states`` with ``ExampleHiddenStatesConnector`` writes, a safetensors file with
``hidden_states`` [T, 4, H] at HF indices 2, N//2, N-3 and the pre-norm final state N, and
``token_ids`` [T], its path in ``kv_transfer_params``.
"""

import json
import os
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, port, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.makedirs(out_dir, exist_ok=True)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
n = model.config.num_hidden_layers
ids = [2, n // 2, n - 3]
captured: dict[str, torch.Tensor] = {}
model.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("pre", a[0]))


class Handler(BaseHTTPRequestHandler):
    def _send(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # /health, /v1/models
        self._send({"object": "list", "data": [{"id": model_dir, "object": "model", "created": 0, "owned_by": "x"}]})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/chat/completions/render"):
            t = tok.apply_chat_template(
                req["messages"], add_generation_prompt=req.get("add_generation_prompt", False), tokenize=True
            )
            return self._send({"token_ids": list(t["input_ids"] if hasattr(t, "keys") else t)})
        if self.path.endswith("/completions"):
            prompt = req["prompt"]
            with torch.no_grad():
                out = model(torch.tensor([prompt]), output_hidden_states=True)
            states = [out.hidden_states[i][0] for i in ids] + [captured["pre"][0]]
            path = os.path.join(out_dir, f"{uuid.uuid4().hex}.safetensors")
            save_file(
                {
                    "hidden_states": torch.stack(states, 1).to(torch.bfloat16).contiguous(),
                    "token_ids": torch.tensor(prompt),
                },
                path,
            )
            choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None, "prompt_token_ids": prompt}
            return self._send(
                {
                    "id": "cmpl-standin",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": req["model"],
                    "choices": [choice],
                    "kv_transfer_params": {"hidden_states_path": path},
                }
            )
        self.send_response(404)
        self.end_headers()


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
