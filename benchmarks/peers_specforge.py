"""SpecForge 0.2.0 on the side-by-side's target without SGLang 0.5.14 (its only capture backend, which
does not import on the image: benchmarks/notes/peer_training.md, "Plan B"): SpecForge's own
tokenization and loss masks, the target's states from a plain HF forward, written in the layout of its
offline capture, so that its trainer and export run as they are. Runs labelled "SpecForge training on
HF-captured features".

    python benchmarks/peers_specforge.py config TARGET OUT.json [DRAFT_VOCAB]
        the draft config SpecForge derives from a target (the target's architecture fields, one layer,
        a 32,000-token draft vocabulary, LlamaForCausalLMEagle3), as a file for its trainer and export
    python benchmarks/peers_specforge.py tied TARGET DIR
        DIR: TARGET's files as links plus a model.safetensors.index.json (its target head reads the
        weight map of one; a single-file checkpoint has none)
    python benchmarks/peers_specforge.py features TARGET CONVERSATIONS.jsonl OUT TEMPLATE MAX_LEN
        OUT/rows_<k>-<k+1000>/data_<i>.ckpt: input_ids [T], loss_mask [T], hidden_state [1, T, H] (the
        final, normed state), aux_hidden_state [1, T, 3H] (outputs of its default layers, 0-based
        [1, N//2 - 1, N - 4]), bf16
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# the target's architecture fields SpecForge copies into its draft (training/model_loading.py)
FIELDS = [
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
]


def draft_config(target: str, out: str, vocab: int = 32000) -> dict:
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(target)
    cfg = {f: getattr(t, f) for f in FIELDS if getattr(t, f, None) is not None}
    rope = getattr(t, "rope_parameters", None) or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "draft_vocab_size": vocab,
    }
    cfg.setdefault("pad_token_id", 0)
    Path(out).write_text(json.dumps(cfg, indent=1))
    return cfg


def tied(target: str, out: str) -> None:
    from safetensors import safe_open

    src, dst = Path(target).resolve(), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = dst / f.name
        if not link.exists():
            link.symlink_to(f)
    index = dst / "model.safetensors.index.json"
    if not (src / index.name).is_file():
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            weights = dict.fromkeys(f.keys(), "model.safetensors")  # noqa: SIM118  (a safe_open handle, not a dict)
        index.write_text(json.dumps({"metadata": {}, "weight_map": weights}))


def features(target: str, data: str, out: str, template: str, max_len: int) -> int:
    import torch
    from datasets import Dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from specforge.utils import safe_conversations_generator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(target)
    rows = Dataset.from_generator(safe_conversations_generator, gen_kwargs={"file_path": data})
    rows = build_eagle3_dataset(
        dataset=rows,
        tokenizer=tok,
        chat_template=template,
        max_length=max_len,
        cache_dir=os.path.join(out, "..", "sf_cache"),
        cache_key=Path(out).name,
        num_proc=min(8, os.cpu_count() or 1),
    )
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    n = model.config.num_hidden_layers
    layers = [1, n // 2 - 1, n - 4]
    t0 = time.time()
    for i, row in enumerate(rows):
        ids = torch.as_tensor(row["input_ids"]).view(-1)
        with torch.no_grad():
            states = model(ids[None].to(device), output_hidden_states=True).hidden_states
        record = {
            "input_ids": ids,
            "loss_mask": torch.as_tensor(row["loss_mask"]).view(-1),
            "hidden_state": states[-1].to(torch.bfloat16).cpu(),
            "aux_hidden_state": torch.cat([states[k + 1] for k in layers], -1).to(torch.bfloat16).cpu(),
        }
        folder = Path(out) / f"rows_{i // 1000 * 1000}-{i // 1000 * 1000 + 1000}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(record, folder / f"data_{i}.ckpt")
        if (i + 1) % 1000 == 0:
            print(f"peers_specforge: {i + 1} of {len(rows)} rows, {time.time() - t0:.0f} s", flush=True)
    print(f"peers_specforge: wrote {len(rows)} rows in {time.time() - t0:.0f} s (layers {layers}) -> {out}")
    return len(rows)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "config":
        draft_config(args[0], args[1], *(int(a) for a in args[2:3]))
    elif what == "tied":
        tied(args[0], args[1])
    elif what == "features":
        features(args[0], args[1], args[2], args[3], int(args[4]))
    else:
        raise SystemExit(f"peers_specforge: what is {what!r}? config, tied or features")
