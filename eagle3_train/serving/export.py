"""``eagle3-export``: a serving checkpoint whose config makes each engine capture exactly the
hidden states the draft was trained on -- or a refusal that says why.

    eagle3-export run=runs/x/train out=runs/x/export engines=[sglang,vllm]

Writes ``config.json`` (``LlamaForCausalLMEagle3``, the draft's shapes, the engine keys computed by
:mod:`eagle3_train.engines.rules`, and an ``eagle3_train`` block with the capture spec, target identity,
vocab map hash and training summary), ``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``, and the norms of the head's forward flags under the engines' names
(``aux_norm`` as ``input_norm``, ``fc_norm.<i>``), with every key each engine version reads for each
flag set in the config (:mod:`eagle3_train.engines.heads`); a flag a named engine version ignores is
refused; no embeddings: SGLang uses the target's; metadata ``format: pt``), the
model card ``README.md`` (:mod:`eagle3_train.serving.card`: the hub's front matter, target, capture,
each engine's serve command, and the τ of any eval report of these files beside the directory) and
``manifest.json`` last. No file names a local path: the target by its hub id or directory name, the
checkpoint by its name and its run by a hash.
A head holding any other weight is refused: neither engine would run it as trained.
From a run directory it exports the best checkpoint when the run kept one (``checkpoint.keep_best``),
else the last.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from safetensors.torch import load_file

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.contract import (
    MANIFEST_NAME,
    CaptureSpec,
    best_checkpoint,
    check_dtype,
    run_checkpoints,
    write_manifest,
)
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fileio import atomic_write_bytes, atomic_write_json, save_safetensors, sha256_file, sha256_text
from eagle3_train.core.log import LogConfig
from eagle3_train.core.stagedir import hold_lock
from eagle3_train.engines import registry
from eagle3_train.engines.heads import FLAG_NAMES, Flags, flag_keys
from eagle3_train.engines.rules import (
    TOP_KEY,
    Unexpressible,
    fc_skipped,
    flag_weights,
    foreign_weights_text,
    ids_for,
    rules_version,
    unloadable_weights,
)
from eagle3_train.model import DraftConfig
from eagle3_train.serving.card import CARD_NAME, eval_reports, model_card, public_name

logger = logging.getLogger(__name__)


@dataclass
class CardConfig:
    """What the model card (``README.md``) says where the checkpoint cannot know it."""

    base_model: str | None = None
    """the target's hub id, for base_model and the serve commands (null: the target as training named it, a local directory by its name)"""
    repo_id: str | None = None
    """the hub id the draft will be published as, for the serve commands (null: the export directory's name)"""
    license: str = "other"
    """the card's license field (a draft trained on a model's outputs normally follows that model's license)"""


@dataclass
class ExportConfig:
    """Options of ``eagle3-export`` (``conf/export.yaml``)."""

    run: str = MISSING  # a training run directory (its best checkpoint under checkpoint.keep_best, else its last) or one checkpoint directory
    out: str = MISSING  # the serving directory to write
    engines: list[str] = field(default_factory=lambda: registry.names("export"))
    """engines the config must serve (those that read config.json: sglang, vllm)"""
    dtype: str = "bfloat16"  # dtype of the exported weights
    overwrite: bool = False  # replace an out= that holds an export of another run (or anything that is not an export)
    card: CardConfig = field(default_factory=CardConfig)
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        known = registry.names("export")
        if not self.engines or any(e not in known for e in self.engines):
            raise ConfigError(f"engines must be a non-empty subset of {known}, got {self.engines}")
        check_dtype(self.dtype)


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


def find_checkpoint(run: Path) -> Path:
    """``run`` itself if it is a finished checkpoint; else, of a finished run, its best checkpoint
    when it kept one (``checkpoint.keep_best``: best eval simulated tau), else its last. A run still
    training (or stopped before its end) is refused: name one of its checkpoints instead."""
    if (run / "state.json").is_file():
        return run
    ckpts = run_checkpoints(run)
    if not ckpts:
        raise BadInputError(f"{run} is neither a checkpoint (state.json) nor a run directory with finished checkpoints")
    if not (run / MANIFEST_NAME).is_file():
        raise ContractError(
            f"{run} is still training, or stopped before its end (no {MANIFEST_NAME}; its last checkpoint "
            f"is {ckpts[-1].name}): to export that checkpoint anyway, name it: run={ckpts[-1]}"
        )
    best = best_checkpoint(run)
    return best if best is not None else ckpts[-1]


def refuse_foreign_out(out: Path, ckpt: Path, overwrite: bool) -> None:
    """An existing ``out`` is replaced only when it is an export of the same run (a re-export), or
    with ``overwrite``: never another model's export, or a directory that is no export at all."""
    if not out.exists() or overwrite:
        return
    manifest = out / MANIFEST_NAME
    try:
        record = json.loads(manifest.read_text()) if manifest.is_file() else None
    except json.JSONDecodeError:
        record = None
    if record is None or record.get("stage") != "export":
        raise ContractError(
            f"{out} exists and is not an export (no export {MANIFEST_NAME}): pass overwrite=true to "
            f"replace it, or choose another out="
        )
    # exports written before run_sha256 existed named the checkpoint by its path
    before = record.get("run_sha256") or run_sha256(Path(str(record.get("checkpoint", ""))))
    if before != run_sha256(ckpt):
        raise ContractError(
            f"{out} holds the export of another run (checkpoint {record.get('checkpoint')}) than "
            f"{ckpt}: pass overwrite=true to replace it, or choose another out="
        )


def run_sha256(ckpt: Path) -> str:
    """Which run a checkpoint belongs to, without naming where it is: a hash of its run's path."""
    ckpt = ckpt.resolve()
    return sha256_text(str(ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt))


def engine_weights(
    weights: dict[str, torch.Tensor], draft_config: DraftConfig, engines: list[str]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names ``engines`` load: the norms of the head's forward
    flags renamed as each engine version reads them (``aux_norm`` -> ``input_norm``)."""
    names = flag_weights(Flags.of(draft_config), draft_config.num_aux, engines)
    return {names.get(k, k): v for k, v in weights.items()}


def refuse_unloadable(names: set[str], draft_config: DraftConfig, engines: list[str]) -> None:
    """Refuse weights that the engines would not load (see ``engines.rules.DRAFT_WEIGHTS``): SGLang
    drops an unknown name silently and runs a different head; vLLM fails on it."""
    allowed = set(flag_weights(Flags.of(draft_config), draft_config.num_aux, engines).values())
    extra = unloadable_weights(names, allowed)
    if extra:
        raise ContractError(
            f"export refused: {foreign_weights_text(registry.names('export'))} the weights {extra}; "
            "they are not part of the EAGLE-3 draft the engines build"
        )


def engine_keys(spec: CaptureSpec, engines: list[str], flags: Flags | None = None) -> dict[str, Any]:
    """The config.json entries that make every engine capture ``spec.aux_indices`` and compute the
    forward ``flags`` (every version read of each engine; one that ignores a flag is refused).

    The top-level key (read by vLLM first) always carries the HF indices themselves, so a config
    exported for SGLang alone still means the same thing to vLLM.
    """
    ks, n, mt = list(spec.aux_indices), spec.num_hidden_layers, spec.target.model_type
    flags = flags or Flags()
    flag_entries, problems = flag_keys(flags, [r for e in engines for r in registry.ENGINES[e].forwards])
    able = [e for e in registry.names("export") if not flag_keys(flags, registry.ENGINES[e].forwards)[1]]
    if problems and able:
        problems.append(f"export for the engines that compute this head: engines={able}")
    entries: dict[tuple[str, ...], Any] = {(TOP_KEY,): ks}  # key path -> ids
    for engine in engines:
        if fc_skipped(engine, len(ks), spec.hidden_size, spec.hidden_size):
            problems.append(
                f"{engine}: the capture {ks} is {len(ks)} layer(s) of width {spec.hidden_size}, the draft's own hidden "
                f"size, so {registry.ENGINES[engine].title} would skip fc and feed the raw state: train with two or more "
                f"aux layers"
            )
            continue
        try:
            for path, ids in ids_for(ks, engine, mt, n).items():
                if entries.get(path, ids) != ids:
                    problems.append(f"{engine}: needs {'.'.join(path)}={ids}, another engine needs {entries[path]}")
                entries[path] = ids
        except Unexpressible as e:
            problems.append(str(e))
    if problems:
        raise ContractError(
            "export refused; the config cannot mean the trained head to every engine:\n  " + "\n  ".join(problems)
        )
    # a nested flag key goes into a block the ids already need (where the engines look first); a
    # block of its own would add nothing to the top-level key they fall back to
    blocks = {path[:-1] for path in entries if len(path) > 1}
    entries.update(
        {p: v for p, v in flag_entries.items() if len(p) == 1 or p[:-1] in blocks or (p[-1],) not in flag_entries}
    )
    out: dict[str, Any] = {}
    for path, ids in entries.items():
        node: dict[str, Any] = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = ids
    return out


def draft_config_json(dc: DraftConfig) -> dict[str, Any]:
    """The Llama-style fields engines build the draft from."""
    rope = dict(dc.rope_parameters)
    theta = rope.pop("rope_theta", 10000.0)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size,
        "num_attention_heads": dc.num_attention_heads,
        "num_key_value_heads": dc.num_key_value_heads,
        "head_dim": dc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": dc.rms_norm_eps,
        "max_position_embeddings": dc.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "rope_parameters": dict(dc.rope_parameters),
        "vocab_size": dc.vocab_size,
        "draft_vocab_size": dc.draft_vocab_size,
        "target_hidden_size": dc.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # both engines size fc (and fc_norm's count) by it first, then by eagle_config's ids, then 3
        "num_aux_hidden_states": dc.num_aux,
    }


def draft_config_from_json(c: dict[str, Any], fc_width: int) -> DraftConfig:
    """The inverse of :func:`draft_config_json`, for any EAGLE-3 draft config.json (ours or a third
    party's: optional fields take the Llama defaults); ``fc_width`` is fc's input width
    (n_aux * H_t), which fixes the number of aux layers."""
    th = c.get("target_hidden_size") or c["hidden_size"]
    rope = c.get("rope_parameters") or (
        {"rope_theta": c.get("rope_theta", 10000.0)} | (c.get("rope_scaling") or {"rope_type": "default"})
    )
    return DraftConfig(
        hidden_size=c["hidden_size"],
        target_hidden_size=th,
        num_aux=fc_width // th,
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        rms_norm_eps=c["rms_norm_eps"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=c.get("draft_vocab_size") or c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters=dict(rope),
    )


class Exporter:
    """Reads a checkpoint, computes the engine keys, writes the serving directory."""

    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg
        self.ckpt = find_checkpoint(Path(cfg.run).expanduser())
        self.state = json.loads((self.ckpt / "state.json").read_text())
        self.spec = CaptureSpec.from_dict(self.state["capture"])
        self.draft_config = DraftConfig(**self.state["draft_config"])
        self.out = Path(cfg.out).expanduser()

    def run(self) -> dict[str, Any]:
        flags = Flags.of(self.draft_config)
        keys = engine_keys(self.spec, list(self.cfg.engines), flags)  # refuses before anything is written
        # one export to out= at a time; the lock lies beside it, as out= itself is replaced by a rename
        self.out.parent.mkdir(parents=True, exist_ok=True)
        hold_lock(self.out.parent, f"export ({self.out.name})", name=f".{self.out.name}.lock")
        tmp, old = (self.out.with_name(f".{self.out.name}.{what}") for what in ("tmp", "old"))
        if old.exists() and self.out.exists():  # an export killed after its swap: the previous one is replaced
            shutil.rmtree(old)
        elif old.exists():  # killed between its renames: the previous one comes back (and is checked below)
            old.rename(self.out)
        refuse_foreign_out(self.out, self.ckpt, self.cfg.overwrite)
        weights = load_file(str(self.ckpt / "draft.safetensors"))
        dtype = getattr(torch, self.cfg.dtype)
        weights = {
            k: v.to(dtype) if v.is_floating_point() else v
            for k, v in weights.items()
            if not k.startswith("embed_tokens")
        }
        weights = engine_weights(weights, self.draft_config, list(self.cfg.engines))
        refuse_unloadable(set(weights), self.draft_config, list(self.cfg.engines))
        config = draft_config_json(self.draft_config) | keys | {"torch_dtype": self.cfg.dtype}
        target = self.spec.target.to_dict() | {"path": public_name(self.spec.target.path)}  # no local path
        config["eagle3_train"] = {
            "capture": self.spec.to_dict() | {"target": target},
            "target": target,
            "vocab_map_sha256": self.state["vocab_sha256"],
            "engines": list(self.cfg.engines),
            "rules_version": rules_version(),
            "training": self._summary(),
            # what computed the states the draft trained on (engine, version, dtype, quantization,
            # parallelism): eagle3-check compares it with the engine named at serving
            "states_from": self.state.get("states_from"),
        }
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_safetensors(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        atomic_write_bytes(tmp / CARD_NAME, self.card(config, tmp).encode())
        options = {k: v for k, v in config_dict(self.cfg).items() if k not in ("run", "out")}  # paths stay out
        write_manifest(
            tmp, "export", {"checkpoint": self.ckpt.name, "run_sha256": run_sha256(self.ckpt), "config": options}
        )
        # renames only, so that a kill anywhere leaves out= whole (old or new) or absent, never
        # half deleted (which a rerun would refuse as "not an export")
        if self.out.exists():
            self.out.rename(old)
        fault_point("export.swap")
        tmp.rename(self.out)
        shutil.rmtree(old, ignore_errors=True)
        shown = {k: v for k, v in keys.items()}
        logger.info(
            f"eagle3-export: {self.ckpt} -> {self.out}; trained HF indices {list(self.spec.aux_indices)} as {shown}"
        )
        return config

    def card(self, config: dict[str, Any], written: Path) -> str:
        """The model card of the files in ``written`` (its τ table from eval reports of exactly
        these files beside ``out``)."""
        files = {name: sha256_file(written / name) for name in ("config.json", "model.safetensors")}
        base = self.cfg.card.base_model or config["eagle3_train"]["target"]["path"]
        if self.cfg.card.base_model is None and base != self.spec.target.path:
            logger.warning(
                f"eagle3-export: the card names the target {base!r}, the name of its local directory: set "
                f"card.base_model=<its hub id> to link the target on the hub"
            )
        return model_card(
            config,
            list(self.cfg.engines),
            base,
            self.cfg.card.repo_id,
            self.out.name,
            self.cfg.card.license,
            eval_reports(self.out, files),
        )

    def _model_options(self) -> dict[str, Any] | None:
        """The run's model options, with each forward flag as its head computes it (true or false,
        whichever option or variant set it: eagle3-check holds each engine version's flags to these)."""
        model, flags = self.state.get("model"), {f: getattr(self.draft_config, f) for f in FLAG_NAMES}
        return (model or {}) | flags if model is not None or any(flags.values()) else None

    def _summary(self) -> dict[str, Any]:
        """What the checkpoint is: its step, the TTT steps it was trained for (eval warns when a
        chain drafts more), its recipe options, its own evaluation and the run's last one."""
        metrics = self.ckpt.parent.parent / "metrics.jsonl"
        evals = (
            [json.loads(x) for x in metrics.read_text().splitlines() if "eval_acc" in x] if metrics.is_file() else []
        )
        own = [e for e in evals if e["step"] == self.state["step"]]
        best = self.state.get("best") or {}
        return {
            "checkpoint": self.ckpt.name,
            "step": self.state["step"],
            "ttt_length": self.state.get("ttt_length"),
            "model": self._model_options(),
            "is_best": best.get("step") == self.state["step"],
            "eval": own[-1] if own else None,
            "last_eval": evals[-1] if evals else None,
        }


main = entry_point("export", ExportConfig, lambda cfg: Exporter(cfg).run())

if __name__ == "__main__":
    main()
