"""Write one small EAGLE-3 export per peer framework, made by that framework's own code, as test
fixtures for eagle3-check / eagle3-eval's readers of foreign drafts (``tests/fixtures/peers/``).

    PYTHONPATH=<speculators>:<modelopt>:<specforge>:<their missing deps> \
        python3 benchmarks/peer_exports.py tests/fixtures/peers

The target is a tiny Llama (8 layers, hidden 64, the tiny targets' byte vocabulary of 320) whose
config is written beside the exports (``target_config.json``); tests rebuild it with
``eagle3_train.targets.tiny.build_tiny_model(config, seed=0)``. Each draft keeps its framework's
initial weights, its default aux layers and its default flags, with a 32-token draft vocabulary
(every third target id), except where a framework has no vocabulary mapping by default (said in
``made_by.json``). Versions read: speculators 0.9.0, nvidia-modelopt 0.47.0, specforge 0.2.0.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from eagle3_train.targets.tiny import _COMMON, build_tiny_model, build_tiny_tokenizer

DRAFT_VOCAB = 32
USED = list(range(0, 3 * DRAFT_VOCAB, 3))  # the draft vocab: target ids 0, 3, 6, ...


def target_config() -> dict:
    return {
        **_COMMON,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "head_dim": 16,
        "tie_word_embeddings": False,
    }


def save_target(out: Path) -> Path:
    from transformers import AutoConfig

    c = dict(target_config())
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    model = build_tiny_model(config, seed=0)
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def speculators_export(target: Path, out: Path) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import TrainConfig
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    n = target_config()["vocab_size"]
    freq = {t: 1000 - t for t in USED}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, n)
    flat = TrainConfig().flatten()
    layer = create_transformer_layer_config(str(target), 1, "llama", "silu", 2048, [])
    flat.update(verifier_name_or_path=str(target), draft_vocab_size=DRAFT_VOCAB, target_layer_ids=None)
    model = Eagle3DraftModel.from_training_args(verifier_config=layer, t2d=t2d, d2t=d2t, **flat)
    _perturb(model)
    model.save_pretrained(out, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    patch_config_dtype(out / "config.json", torch.bfloat16)
    return {"flags": {k: flat.get(k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}}


def modelopt_export(target: Path, out: Path) -> dict:
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16)
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    # the draft layer's shapes follow the target's (its default is Llama-3.1-8B's layer)
    cfg["eagle_architecture_config"].update(
        {
            "head_dim": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "draft_vocab_size": DRAFT_VOCAB,
        }
    )
    cfg["eagle_use_torch_compile"] = False
    mtsp.convert(model, [("eagle", cfg)])
    with torch.no_grad():
        model.eagle_module.d2t.copy_(torch.tensor(USED) - torch.arange(DRAFT_VOCAB))
    _perturb(model.eagle_module)
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(out))
    return {"aux_ids": list(model.eagle_config.eagle_aux_hidden_state_layer_ids)}


def specforge_export(target: Path, out: Path) -> dict:
    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    t = target_config()
    # as SpecForge's shipped configs/llama3-8B-eagle3.json: no eagle_config, so the default capture
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "max_position_embeddings": t["max_position_embeddings"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "rms_norm_eps": t["rms_norm_eps"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": t["vocab_size"],
        "draft_vocab_size": DRAFT_VOCAB,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "draft.json"
        cfg.write_text(json.dumps(draft))
        model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(cfg)), torch_dtype=torch.bfloat16)
        _perturb(model)
        state = {k: v for k, v in model.state_dict().items() if "embed" not in k}
        vm = {
            "d2t": torch.tensor(USED) - torch.arange(DRAFT_VOCAB),
            "t2d": torch.tensor([i in USED for i in range(t["vocab_size"])]),
        }
        torch.save(vm, Path(tmp) / "vm.pt")
        torch.save({"draft_state_dict": state, "strategy": "eagle3"}, Path(tmp) / "state.pt")
        export_to_sglang(str(Path(tmp) / "state.pt"), str(cfg), str(out), vocab_mapping_path=str(Path(tmp) / "vm.pt"))
    return {}


def _perturb(module: torch.nn.Module) -> None:
    """Norm weights away from their initial ones, so a reader that drops or swaps a norm is seen."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name:
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=g).to(p.dtype))


MAKERS = {"speculators": speculators_export, "modelopt": modelopt_export, "specforge": specforge_export}
PACKAGES = {"speculators": "speculators", "modelopt": "nvidia-modelopt", "specforge": "specforge"}


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    root = Path(argv[0] if argv else "tests/fixtures/peers")
    root.mkdir(parents=True, exist_ok=True)
    (root / "target_config.json").write_text(json.dumps(target_config(), indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        target = save_target(Path(tmp) / "target")
        for name, make in MAKERS.items():
            out = root / name
            shutil.rmtree(out, ignore_errors=True)
            torch.manual_seed(0)
            extra = make(target, out)
            for junk in ("config.py",):  # speculators' auto_map module: code, not needed to read the draft
                (out / junk).unlink(missing_ok=True)
            made = {
                "framework": PACKAGES[name],
                "version": importlib.metadata.version(PACKAGES[name]),
                "script": "benchmarks/peer_exports.py",
                "draft_vocab": DRAFT_VOCAB,
                **extra,
            }
            (out / "made_by.json").write_text(json.dumps(made, indent=1) + "\n")
            print(name, sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main(sys.argv[1:])
