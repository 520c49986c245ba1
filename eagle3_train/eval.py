"""``eagle3-eval``: speculative decoding with the real target, from the exported directory alone.

    eagle3-eval draft=runs/x/export target=embedded engine=sglang prompts=data_prep/prompts/heldout.jsonl

The draft is built from ``config.json`` + ``model.safetensors`` (embeddings: the target's, as SGLang
does). Which target layers feed it is derived from the config by the chosen engine's rule
(:mod:`eagle3_train.engines`), not from our own metadata, so a config that would make the engine
capture the wrong layers shows up as a low acceptance. Greedy chain of ``k`` draft tokens; the
target keeps its KV cache and crops it after each verify, so a verify step is one target forward.
The output is checked token for token against plain greedy decoding of the target (lossless).
Writes ``report.json`` and ``acceptance.png`` to ``out``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from safetensors.torch import load_file
from tqdm.auto import tqdm

from eagle3_train.cli import config_dict, entry_point
from eagle3_train.engines import resolve
from eagle3_train.errors import BadInputError, ConfigError, ContractError
from eagle3_train.fileio import atomic_write_json, sha256_file, sha256_json
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.targets import Target, eos_ids, load_target, text_config


@dataclass
class EvalConfig:
    """Options of ``eagle3-eval`` (``conf/eval.yaml``)."""

    draft: str = MISSING  # an exported draft directory (config.json + model.safetensors)
    target: str = "embedded"  # the target (any form load_target takes)
    engine: str = "sglang"  # whose rule turns the config's ids into captured layers: sglang | vllm
    prompts: str = MISSING  # JSONL of {"messages": [...]} (the first user turn, with a leading system prompt)
    out: str | None = None  # where report.json and acceptance.png go (null: <draft>/eval-<engine>)
    k: int = 5  # draft tokens per verify step (chain)
    max_new_tokens: int = 128  # generated tokens per prompt
    limit: int | None = None  # only the first N prompts
    device: str = "auto"  # auto: cuda if present, else cpu
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    cache_dir: str | None = None  # where GGUF targets are converted once
    chat_template: str | None = None  # replaces the tokenizer's template (as in prepare)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ("sglang", "vllm"):
            raise ConfigError(f"engine must be sglang or vllm, got {self.engine!r}")
        if self.k < 1 or self.max_new_tokens < 1:
            raise ConfigError("k and max_new_tokens must be >= 1")


ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


def load_draft(directory: Path, target: Target) -> tuple[Eagle3Draft, dict]:
    """Build the draft from an exported directory; the embeddings are the target's."""
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise BadInputError(f"{directory} lacks config.json or model.safetensors: not an exported draft")
    c = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    if "fc.weight" not in weights:
        raise BadInputError(f"{directory}/model.safetensors has no fc.weight")
    th = c.get("target_hidden_size", c["hidden_size"])
    width = weights["fc.weight"].shape[1]
    rope = c.get("rope_parameters") or ({"rope_theta": c.get("rope_theta", 10000.0)} | (c.get("rope_scaling") or {"rope_type": "default"}))
    dc = DraftConfig(
        hidden_size=c["hidden_size"], target_hidden_size=th, num_aux=width // th,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], intermediate_size=c["intermediate_size"],
        rms_norm_eps=c["rms_norm_eps"], vocab_size=c["vocab_size"], draft_vocab_size=c.get("draft_vocab_size", c["vocab_size"]),
        max_position_embeddings=c["max_position_embeddings"], rope_parameters=rope,
    )
    if dc.vocab_size != target.vocab_size or dc.hidden_size != target.hidden_size:
        raise ContractError(
            f"{directory}: draft vocab {dc.vocab_size} / hidden {dc.hidden_size} do not fit target "
            f"{target.identity.path} (vocab {target.vocab_size}, hidden {target.hidden_size})"
        )
    model = Eagle3Draft(dc)
    weights["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float()
    if "d2t" not in weights:
        weights["d2t"] = torch.zeros(dc.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in weights:
        weights["t2d"] = torch.zeros(dc.vocab_size, dtype=torch.bool)
    missing, unexpected = model.load_state_dict({k: v for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise BadInputError(f"{directory}/model.safetensors: missing {missing}, unexpected {unexpected}")
    ids = weights["d2t"] + torch.arange(dc.draft_vocab_size)
    if ids.min() < 0 or ids.max() >= dc.vocab_size:
        raise ContractError(f"{directory}: d2t maps draft ids outside the target vocab of {dc.vocab_size}")
    return model.eval(), c


def short_training_warning(config: dict, k: int) -> str | None:
    """A warning when the exported draft was trained with fewer TTT steps than the chain drafts
    (``eagle3_train.training.ttt_length`` of its config.json): positions past it were never trained
    and accept less. None when it was trained for k or more, or the config does not say."""
    ttt = ((config.get("eagle3_train") or {}).get("training") or {}).get("ttt_length")
    if ttt is None or ttt >= k:
        return None
    return (f"the draft was trained with ttt_length={ttt} but drafts chains of k={k}: draft positions "
            f"{ttt + 1}..{k} were never trained; train with train.ttt_length>={k} or evaluate with k={ttt}")


class SpecDecoder:
    """Greedy chain speculative decoding: target (transformers, KV cache) + draft.

    Args:
        target: the loaded target.
        draft: the draft head.
        layers: HF indices whose states feed the draft (``N`` = the last layer's pre-norm output,
            what an engine captures for it).
        k: draft tokens per verify step.
        eos: ids that end generation.
    """

    def __init__(self, target: Target, draft: Eagle3Draft, layers: list[int], k: int, eos: set[int]):
        self.target, self.draft, self.layers, self.k, self.eos = target.model, draft, layers, k, eos
        self.n = target.num_hidden_layers
        self.device = next(self.target.parameters()).device
        self.dtype = next(self.target.parameters()).dtype
        self._prenorm: list[torch.Tensor] = []
        if self.n in layers:  # engines capture the last layer before the final norm
            self.target.base_model.layers[-1].register_forward_hook(
                lambda m, i, o: self._prenorm.append(o[0] if isinstance(o, tuple) else o))
        self.target_seconds = self.draft_seconds = 0.0

    def _target(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over ``ids`` [1, m] with the cache: logits [m, V], aux [m, n*H]."""
        start = time.perf_counter()
        self._prenorm.clear()
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        states = [self._prenorm[-1] if k == self.n else out.hidden_states[k] for k in self.layers]
        aux = torch.cat(states, dim=-1)[0]
        logits = out.logits[0]
        self._sync()
        self.target_seconds += time.perf_counter() - start
        return logits, aux

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _draft(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> list[int]:
        """k draft tokens (target ids) after the context: aux [T, n*H], next_tokens [T] (token t+1)."""
        start = time.perf_counter()
        d = self.draft
        t = aux.shape[0]
        hidden = d.fc(aux[None].to(d.fc.weight.dtype))  # [1, T, n*H] -> [1, T, H]
        cos, sin = d.rotary_emb(hidden, torch.arange(t, device=hidden.device)[None])
        cache: list = []
        out = d.midlayer(d.embed_tokens(next_tokens[None]), hidden, cos, sin, cache)[:, -1:]
        drafts = []
        for i in range(self.k):
            draft_id = int(d.logits(out)[0, -1].argmax())
            token = draft_id + int(d.d2t[draft_id])
            drafts.append(token)
            if i + 1 == self.k:
                break
            # chain step i+1 at position T-1+i+1: sees the context and its own earlier steps
            cos, sin = d.rotary_emb(out, torch.tensor([[t + i]], device=out.device))
            out = d.midlayer(d.embed_tokens(torch.tensor([[token]], device=out.device)), out, cos, sin, cache)
        self._sync()
        self.draft_seconds += time.perf_counter() - start
        return drafts

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list[int]]:
        """Greedy speculative decoding; returns the new tokens and each verify step's accepted count."""
        from transformers import DynamicCache

        cache = DynamicCache()
        logits, aux = self._target(torch.tensor([prompt], device=self.device), cache)
        seq = list(prompt) + [int(logits[-1].argmax())]  # the cache holds all of seq but its last token
        accepted: list[int] = []
        while len(seq) - len(prompt) < max_new and seq[-1] not in self.eos:
            drafts = self._draft(aux, torch.tensor(seq[1:], device=self.device))
            logits, new_aux = self._target(torch.tensor([[seq[-1]] + drafts], device=self.device), cache)
            greedy = logits.argmax(-1).tolist()  # [k+1]: the target's token after each prefix
            a = 0
            while a < self.k and drafts[a] == greedy[a] and drafts[a] not in self.eos:
                a += 1
            drop = cache.get_seq_length() - (len(seq) + a)  # the rejected drafts' entries
            if drop > 0:
                cache.crop(-drop)  # negative: "remove this many" in every transformers version
            aux = torch.cat([aux, new_aux[: a + 1]])
            seq += drafts[:a] + [greedy[a]]
            accepted.append(a)
        new = seq[len(prompt) :]
        for i, tok in enumerate(new):  # as plain greedy decoding: stop at the first eos
            if tok in self.eos:
                new = new[: i + 1]
                break
        return new[:max_new], accepted

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """Plain greedy decoding of the target, the reference for losslessness."""
        out = self.target.generate(torch.tensor([prompt], device=self.device), max_new_tokens=max_new, do_sample=False,
                                   eos_token_id=sorted(self.eos), pad_token_id=sorted(self.eos)[0])
        return out[0, len(prompt) :].tolist()


class Evaluator:
    """Loads target + exported draft, decodes every prompt, writes the report."""

    def __init__(self, cfg: EvalConfig):
        import torch as _torch

        self.cfg = cfg
        device = cfg.device if cfg.device != "auto" else ("cuda" if _torch.cuda.is_available() else "cpu")
        self.target = load_target(cfg.target, cache_dir=cfg.cache_dir, dtype=cfg.dtype, device=device, chat_template=cfg.chat_template)
        self.draft_dir = Path(cfg.draft).expanduser()
        self.draft, self.config = load_draft(self.draft_dir, self.target)
        if (warning := short_training_warning(self.config, cfg.k)) is not None:
            print(f"eagle3-eval: warning: {warning}", file=sys.stderr, flush=True)
        self.draft.to(device, next(self.target.model.parameters()).dtype)
        tc = text_config(self.target.config)
        resolutions = resolve(self.config, cfg.engine, tc.model_type, tc.num_hidden_layers)
        self.resolution = resolutions[0]
        self.layers = self.resolution.hf_indices
        if any(k < 0 or k > tc.num_hidden_layers for k in self.layers):
            raise ContractError(f"{cfg.engine} would capture HF indices {self.layers}, outside 0..{tc.num_hidden_layers}")
        if len(self.layers) * tc.hidden_size != self.draft.fc.in_features:
            raise ContractError(
                f"{cfg.engine} would capture {len(self.layers)} layers ({self.layers}; read from "
                f"{self.resolution.source}) = width {len(self.layers) * tc.hidden_size}, but fc takes "
                f"{self.draft.fc.in_features}: the engine would fail to run this draft"
            )
        eos = eos_ids(self.target.model, self.target.tokenizer)
        self.decoder = SpecDecoder(self.target, self.draft, self.layers, cfg.k, eos)
        self.out = Path(cfg.out).expanduser() if cfg.out else self.draft_dir / f"eval-{cfg.engine}"

    def prompts(self) -> list[list[int]]:
        path = Path(self.cfg.prompts).expanduser()
        if not path.is_file():
            raise BadInputError(f"prompts file {path} does not exist")
        out = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = row["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise BadInputError(f"{path}:{lineno}: expected an object with 'messages' ({e})") from None
            first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
            if first is None:
                raise BadInputError(f"{path}:{lineno}: field 'messages': no user turn")
            out.append(self.target.tokenizer.apply_chat_template(messages[: first + 1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            if self.cfg.limit and len(out) >= self.cfg.limit:
                break
        return out

    def fingerprint(self) -> str:
        """What decides the report: options (not where it goes), the draft files, the target."""
        opts = {k: v for k, v in config_dict(self.cfg).items() if k not in ("out", "progress")}
        files = {p.name: sha256_file(p) for p in (self.draft_dir / "config.json", self.draft_dir / "model.safetensors")}
        return sha256_json({"options": opts, "draft": files, "target": self.target.identity.to_dict()})

    def run(self) -> dict[str, Any]:
        k = self.cfg.k
        report_path = self.out / "report.json"
        fingerprint = self.fingerprint()
        if report_path.is_file():
            old = json.loads(report_path.read_text())
            if old.get("fingerprint") == fingerprint:
                print(f"eagle3-eval: {report_path} is up to date (tau {old['tau']:.2f}); nothing to do")
                return old
        reached, hits = [0] * k, [0] * k
        steps, tokens, lossless = [], 0, 0
        prompts = self.prompts()
        for prompt in tqdm(prompts, desc=f"eval {self.cfg.engine}", disable=not self.cfg.progress):
            new, accepted = self.decoder.generate(prompt, self.cfg.max_new_tokens)
            lossless += new == self.decoder.greedy(prompt, self.cfg.max_new_tokens)
            steps += accepted
            tokens += len(new)
            for a in accepted:
                for i in range(min(a + 1, k)):
                    reached[i] += 1
                for i in range(a):
                    hits[i] += 1
        per_position = [h / r if r else 0.0 for h, r in zip(hits, reached)]
        report = {
            "engine": self.cfg.engine, "rule": self.resolution.rule.versions, "ids_read_from": self.resolution.source,
            "ids": self.resolution.ids, "captured_hf_indices": self.layers,
            "trained_hf_indices": self.config.get("eagle3_train", {}).get("capture", {}).get("aux_indices"),
            "trained_ttt_length": self.config.get("eagle3_train", {}).get("training", {}).get("ttt_length"),
            "prompts": len(prompts), "k": k, "tokens": tokens, "verify_steps": len(steps),
            "tau": (sum(steps) + len(steps)) / max(len(steps), 1),
            "acceptance_per_position": per_position,
            "lossless_prompts": lossless, "lossless": lossless == len(prompts),
            "target_seconds": self.decoder.target_seconds, "draft_seconds": self.decoder.draft_seconds,
            "config": config_dict(self.cfg),
            "fingerprint": fingerprint,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out / "report.json", report)
        plot_acceptance(per_position, report["tau"], self.out / "acceptance.png")
        print(f"eagle3-eval ({self.cfg.engine}: HF {self.layers} from {self.resolution.source}): tau {report['tau']:.2f} "
              f"over {len(steps)} verify steps, acceptance per position {[round(p, 3) for p in per_position]}, "
              f"lossless {lossless}/{len(prompts)}; target {report['target_seconds']:.1f} s, draft "
              f"{report['draft_seconds']:.1f} s -> {self.out}")
        return report


def plot_acceptance(per_position: list[float], tau: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(1, len(per_position) + 1), per_position, color="#4477aa")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title=f"tau = {tau:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


main = entry_point("eval", EvalConfig, lambda cfg: Evaluator(cfg).run())

if __name__ == "__main__":
    main()
