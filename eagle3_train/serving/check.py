"""``eagle3-check``: what will each engine capture for this draft, and is it what it was trained on?

    eagle3-check draft=runs/x/export target=meta-llama/Llama-3.1-8B-Instruct
    eagle3-check draft=some/third_party_draft target=/models/target/config.json trained=[2,16,29]

Works on any EAGLE-3 draft directory. For each engine runner (the engine's default runner first:
vLLM 0.33's V2) it prints where the ids are read, the HF indices captured, and the trained indices (from the draft's ``eagle3_train`` block, or
``trained=`` for third-party drafts); it flags silent fallbacks (no key where the engine reads, so
the engine default), a draft whose ``fc`` SGLang would skip, ``d2t`` problems, and weights the
engines would not load. Exits 1 on any
mismatch or problem, 0 otherwise.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from safetensors import safe_open

from eagle3_train.core.cli import entry_point
from eagle3_train.core.errors import ConfigError
from eagle3_train.core.log import LogConfig
from eagle3_train.core.reasoning import check_template_kwargs, kwargs_warning, trained_kwargs
from eagle3_train.engines import registry
from eagle3_train.engines.base import attention_shape, lookup, named_dtype
from eagle3_train.engines.rules import fc_skipped, foreign_weights_text, resolve, rules_for, unloadable_weights
from eagle3_train.serving.drafts import OURS, DraftDir, read_draft_dir
from eagle3_train.targets import text_config

logger = logging.getLogger(__name__)


@dataclass
class ServingConfig:
    """The serving engine as eagle3-check compares it with the draft's ``states_from`` record
    (``serving.*``; null: not compared)."""

    engine: str | None = None  # vllm | sglang | trtllm
    version: str | None = None  # the engine's release
    dtype: str | None = None  # the dtype the target is served in
    quantization: str | None = None  # the target's quantization at serving (none: unquantized)
    tensor_parallel_size: int | None = None  # the target's tensor parallelism at serving
    chat_template_kwargs: Any = None
    """the flags requests will carry (serving.chat_template_kwargs={enable_thinking:false}): compared with those the training data was rendered with (null: not compared)"""


@dataclass
class CheckConfig:
    """Options of ``eagle3-check`` (``conf/check.yaml``)."""

    draft: str = MISSING  # an EAGLE-3 draft directory (config.json + *.safetensors)
    target: str = MISSING  # the target: a config.json, an HF directory, a hub id, embedded or tiny
    trained: list[int] | None = None  # HF indices the draft was trained on (null: its eagle3_train block)
    engines: list[str] = field(default_factory=lambda: registry.names("export"))
    """engines to check (any with layer-id rules: sglang, vllm, trtllm)"""
    cache_dir: str | None = None  # where GGUF targets are converted once
    serving: ServingConfig = field(default_factory=ServingConfig)
    """how the draft will be served (serving.engine=vllm serving.quantization=fp8 ...): compared with what computed the states it trained on"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        check_template_kwargs(self.serving.chat_template_kwargs, "serving.chat_template_kwargs")
        known = registry.names("rules")
        unknown = [e for e in self.engines if e not in known]
        if unknown:
            raise ConfigError(f"unknown engines {unknown}; known: {known}")


ConfigStore.instance().store(name="check_schema", node=CheckConfig)


@dataclass
class Finding:
    level: str  # "error" (exit 1) or "warning"
    text: str


def target_config(target: str, cache_dir: str | None) -> Any:
    """The target's transformers config, from a config.json file or any form load_target takes."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".json":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else _config_from(path)
    from eagle3_train.targets import load_target

    return load_target(target, cache_dir=cache_dir, load_model=False).config


def _config_from(path: Path) -> Any:
    from transformers import AutoConfig

    d = json.loads(path.read_text())
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _vocab_tensors(dd: DraftDir) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in dd.files:
        with safe_open(str(f), framework="pt") as st:
            for key in list(st.keys()):
                if key.split(".")[-1] in ("d2t", "t2d"):
                    tensors[key.split(".")[-1]] = st.get_tensor(key)
                elif key.endswith("fc.weight"):
                    tensors["fc.weight"] = st.get_tensor(key)
    return tensors


def foreign_findings(dd: DraftDir, engines: list[str], fc_width: int | None) -> tuple[list[str], list[Finding]]:
    """What eagle3-check says of a draft another framework exported: who wrote it, what it records
    and leaves unsaid, the engines that cannot load it, weights they would skip, and where they
    compute it otherwise than its producer trained it."""
    lines = [f"format: {dd.title} export"]
    recorded = dd.recorded()
    if recorded:
        lines.append("it records: " + "; ".join(recorded))
    lines.append("it leaves unsaid: " + "; ".join(dd.unsaid()))
    findings = [Finding("error", r) for e in engines if (r := dd.refusal(e, fc_width)) is not None]
    findings += [Finding("error", p) for p in dd.weight_problems()]
    findings += [Finding("warning", f"{dd.title}: {note}") for note in dd.train_serve_notes()]
    return lines, findings


def check(
    config: dict,
    tensors: dict[str, torch.Tensor],
    target_cfg: Any,
    trained: list[int] | None,
    engines: list[str],
    weight_names: set[str] | None = None,
) -> tuple[list[str], list[Finding]]:
    """Report lines and findings for one draft (pure: no I/O); ``weight_names`` (all the draft's
    tensors) are checked against what the engines load, when given."""
    tc = text_config(target_cfg)
    n, h, v, mt = tc.num_hidden_layers, tc.hidden_size, tc.vocab_size, tc.model_type
    lines = [f"target: model_type {mt}, N={n}, hidden {h}, vocab {v}; trained on HF indices {trained or 'unknown'}"]
    findings: list[Finding] = []
    for engine in engines:
        if not rules_for(engine, mt):
            e = registry.ENGINES[engine]
            # an engine that refuses the target at load fails for sure; one whose code was not read may not
            refused = e.serves is not None and mt not in e.serves
            findings.append(Finding("error" if refused else "warning", e.unserved(mt)))
            continue
        for r in resolve(config, engine, mt, n):  # the engine's default runner first
            where = f"{r.source}={r.ids}" if r.ids is not None else "no ids where it reads -> engine default"
            ok = trained is None or (r.hf_indices == sorted(trained) and not r.pre_norm_final)
            lines.append(
                f"{engine} {r.rule.versions}: {where} -> captures {r.describe()}"
                + ("" if trained is None else ("  OK" if ok else f"  MISMATCH (trained {sorted(trained)})"))
            )
            if r.problem is not None:
                findings.append(Finding("error", r.problem))
            if r.pre_norm_final and r.note:
                findings.append(
                    Finding(
                        "error",
                        f"{r.note}: it feeds the last layer's output before the final norm "
                        f"there, which no draft trained here saw",
                    )
                )
            elif r.pre_norm_final:
                findings.append(
                    Finding(
                        "warning",
                        f"{engine} {r.rule.versions}: one id lands on N={n}, the last layer's "
                        f"output before the final norm; no HF index names it (HF {n} is "
                        f"after the norm), so no draft trained here saw it",
                    )
                )
            if r.ids is None and _get_any(config):
                findings.append(
                    Finding(
                        "error" if not ok or trained is None else "warning",
                        f"{engine} {r.rule.versions}: the ids are not where it reads "
                        f"({' or '.join('.'.join(p) for p in r.rule.keys)}): it silently uses the default {r.hf_indices}",
                    )
                )
            if not ok and trained is not None:  # (not ok: trained is known)
                findings.append(
                    Finding(
                        "error",
                        f"{engine} {r.rule.versions}: captures {r.describe()}, the draft was trained on {sorted(trained)}",
                    )
                )
            if any(k < 0 or k > n for k in r.hf_indices):
                findings.append(
                    Finding("error", f"{engine} {r.rule.versions}: HF indices {r.hf_indices} are outside 0..{n}")
                )
        fc = tensors.get("fc.weight")  # [H_draft, width of the captured states]
        if fc is not None and fc_skipped(engine, 1, fc.shape[1], fc.shape[0]):
            findings.append(
                Finding(
                    "error",
                    f"{engine}: fc input width {fc.shape[1]} equals the draft hidden size, so "
                    f"{registry.ENGINES[engine].title} skips fc",
                )
            )
    findings += _check_target(config, tensors, target_cfg, trained)
    findings += _check_vocab(config, tensors, v)
    findings += _check_dtype(config, target_cfg, engines)
    # embed_tokens is loaded too (SGLang then swaps in the target's): only other names are foreign
    foreign = unloadable_weights((weight_names or set()) - {"embed_tokens.weight"})
    if foreign:
        findings.append(
            Finding(
                "error",
                f"weights {foreign} are not part of the EAGLE-3 draft the engines build: "
                f"{foreign_weights_text(registry.names('export'))} them",
            )
        )
    return lines, findings


def _check_target(
    config: dict, tensors: dict[str, torch.Tensor], target_cfg: Any, trained: list[int] | None
) -> list[Finding]:
    """Is this the target the draft was trained against? Its shapes (fc's input is the captured
    states' width; the capture records the target's hidden size, vocab, depth and model_type) and,
    as a warning, its config hash (a quantized or re-saved copy of the same model differs there)."""
    from eagle3_train.targets import config_hash

    tc = text_config(target_cfg)
    out: list[Finding] = []
    fc = tensors.get("fc.weight")
    if fc is not None and trained and fc.shape[1] != len(trained) * tc.hidden_size:
        out.append(
            Finding(
                "error",
                f"fc takes states of width {fc.shape[1]}, but {len(trained)} layers of this target "
                f"(hidden {tc.hidden_size}) are {len(trained) * tc.hidden_size} wide: not the target "
                f"the draft was trained on",
            )
        )
    capture = (config.get("eagle3_train") or {}).get("capture") or {}
    recorded = {
        "hidden_size": capture.get("hidden_size"),
        "vocab_size": capture.get("vocab_size"),
        "num_hidden_layers": capture.get("num_hidden_layers"),
        "model_type": (capture.get("target") or {}).get("model_type"),
    }
    here = {
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "num_hidden_layers": tc.num_hidden_layers,
        "model_type": tc.model_type,
    }
    differ = [
        f"{k} {recorded[k]} (trained) != {here[k]} (this target)"
        for k in here
        if recorded[k] is not None and recorded[k] != here[k]
    ]
    if differ:
        out.append(
            Finding(
                "error",
                f"the draft was trained against another target ({(capture.get('target') or {}).get('path')}): "
                + "; ".join(differ),
            )
        )
    elif (
        (recorded_hash := (capture.get("target") or {}).get("config_hash")) is not None
        and hasattr(target_cfg, "to_dict")
        and recorded_hash != config_hash(target_cfg)
    ):
        out.append(
            Finding(
                "warning",
                f"the target's config differs from the one the draft was trained against "
                f"({capture['target'].get('path')}; same shapes): fine for a quantized or re-saved "
                f"copy of that model, not for another model",
            )
        )
    return out


def _check_dtype(config: dict, target_cfg: Any, engines: list[str]) -> list[Finding]:
    """A warning per engine that runs the draft in its own config's dtype (``Engine.draft_dtype_own``)
    where the draft's and the target's configs name different dtypes."""
    draft, target = named_dtype(config), named_dtype(target_cfg)
    return [
        Finding("warning", f"{e.title}: {clash}: serve with --dtype {draft} (or export dtype={target})")
        for e in (registry.ENGINES[name] for name in engines)
        if (clash := e.dtype_clash(draft, target)) is not None
    ]


def _check_attention(layer: dict, target_cfg: Any, engines: list[str]) -> list[Finding]:
    """A warning per engine that plans the draft's attention with the target's shape
    (``Engine.attention_planned_by_target``) where the draft's layer is shaped otherwise."""
    draft, target = attention_shape(layer), attention_shape(text_config(target_cfg))
    return [
        Finding("warning", f"{e.title}: {clash}")
        for e in (registry.ENGINES[name] for name in engines)
        if (clash := e.attention_clash(draft, target)) is not None
    ]


def _get_any(config: dict) -> bool:
    """Whether the config holds ids where some engine reads them."""
    return any(lookup(config, path) is not None for e in registry.ENGINES.values() for r in e.rules for path in r.keys)


def _check_vocab(config: dict, tensors: dict[str, torch.Tensor], v: int) -> list[Finding]:
    out = []
    d2t = tensors.get("d2t")
    if d2t is None:
        if config.get("draft_vocab_size", v) != v:
            out.append(
                Finding(
                    "error",
                    "no d2t tensor, but draft_vocab_size differs from the target vocab: engines cannot map draft ids",
                )
            )
        return out
    ids = d2t.to(torch.int64) + torch.arange(len(d2t))
    if len(d2t) < v and bool((d2t == 0).all()):
        out.append(
            Finding(
                "error",
                f"d2t is all zeros: the draft vocab would be target ids 0..{len(d2t) - 1}, almost surely not the trained map",
            )
        )
    if len(ids) and (ids.min() < 0 or ids.max() >= v):
        out.append(
            Finding(
                "error",
                f"d2t maps draft ids outside the target vocab of {v} (range {int(ids.min())}..{int(ids.max())})",
            )
        )
    elif len(torch.unique(ids)) != len(ids):
        out.append(
            Finding("error", "d2t maps two draft ids to the same target id: not a permutation into the target vocab")
        )
    t2d = tensors.get("t2d")
    if (
        t2d is not None
        and t2d.numel() == v
        and not torch.equal(t2d.bool().nonzero().squeeze(1), torch.sort(ids).values)
    ):
        out.append(Finding("error", "t2d does not mark exactly the target ids d2t maps to"))
    return out


# the states_from fields serving.* is compared on: its own fields
STATES_FIELDS = tuple(f.name for f in fields(ServingConfig) if f.name != "chat_template_kwargs")


def check_states_from(config: dict, serving: ServingConfig) -> tuple[list[str], list[Finding]]:
    """What computed the states the draft trained on (its export's ``states_from``), beside the
    serving engine of ``serving.*``: a warning per field that differs (the draft then sees states
    of other numerics than it learnt: another engine's kernels, another quantization)."""
    record = (config.get("eagle3_train") or {}).get("states_from")
    if not record:
        return ["states: not recorded (a draft trained elsewhere, or before the record existed)"], []
    shown = ", ".join(f"{k} {record.get(k)}" for k in STATES_FIELDS if record.get(k) is not None)
    lines = [f"states: the draft trained on states from {shown}"]
    asked = {k: getattr(serving, k) for k in STATES_FIELDS if getattr(serving, k) is not None}
    if "quantization" in asked and str(asked["quantization"]).lower() in ("none", ""):
        asked["quantization"] = None
    findings = []
    for key, want in asked.items():
        have = record.get(key, 1 if key == "tensor_parallel_size" else None)
        if key == "engine" and have == "transformers":
            continue  # transformers is no serving engine; a served dump or served training records one
        if str(have) != str(want):
            findings.append(
                Finding(
                    "warning",
                    f"the draft trained on states with {key} {have}, it will be served with {key} {want}: the states "
                    f"it gets at serving differ from those it learnt (train with source=served against the serving engine)",
                )
            )
    return lines, findings


def _aux_norm_mismatch(dd: DraftDir) -> Finding | None:
    """Our export whose config and training disagree on model.aux_norm: trained with it but
    ``norm_before_fc`` lost (both engines would leave its input_norm out), or the flag set without
    the norm trained or its weight (both would normalise fc's input by a norm the head never had)."""
    trained = bool((((dd.config.get("eagle3_train") or {}).get("training") or {}).get("model") or {}).get("aux_norm"))
    flagged, held = dd.flags("vllm").aux_norm, "aux_norm.weight" in {dd.our_name(n) for n in dd.names}
    if trained and not flagged:
        return Finding(
            "error",
            "the head was trained with model.aux_norm (its norm is input_norm.weight), but config.json sets "
            "norm_before_fc neither at its top level nor in eagle_config: both engines would leave that norm out; export the run again",
        )
    if flagged and not (trained and held):
        why = "the head was not trained with model.aux_norm" if not trained else "the weights hold no input_norm"
        return Finding(
            "error",
            f"config.json sets norm_before_fc but {why}: both engines would normalise fc's input by a norm "
            "the head never had; export the run again",
        )
    return None


def run_check(cfg: CheckConfig) -> int:
    draft = Path(cfg.draft).expanduser()
    dd = read_draft_dir(draft)
    config, tensors, names = dd.config, _vocab_tensors(dd), {dd.our_name(n) for n in dd.names}
    target_cfg = target_config(cfg.target, cfg.cache_dir)
    head: list[str] = []
    foreign: list[Finding] = []
    trained = list(cfg.trained) if cfg.trained is not None else None
    if dd.producer != OURS:
        fc = tensors.get("fc.weight")
        head, foreign = foreign_findings(dd, list(cfg.engines), None if fc is None else fc.shape[1])
        if trained is None:
            capture = dd.capture(text_config(target_cfg).num_hidden_layers)
            head.append(f"trained on: HF {capture.hf_indices}, {capture.source}")
            trained = capture.hf_indices if capture.recorded else None
    elif trained is None:
        trained = config.get("eagle3_train", {}).get("capture", {}).get("aux_indices")
    names -= dd.extra_weights()  # weights its flags account for (ours: model.aux_norm's, as input_norm)
    if dd.producer != OURS:  # weights an engine loads and never applies: said once, by weight_problems
        names -= {n for engine in ("vllm", "sglang") for n in dd.skipped_by(engine)}
    elif (mismatch := _aux_norm_mismatch(dd)) is not None:
        foreign.append(mismatch)
        names.discard("aux_norm.weight")  # said once, by its file's name
    elif dd.flags("vllm").aux_norm:
        head.append("forward: one RMSNorm over fc's input (input_norm, norm_before_fc), as trained with model.aux_norm")
    lines, findings = check(config, tensors, target_cfg, trained, list(cfg.engines), names)
    lines, findings = head + lines, foreign + findings + _check_attention(dd.layer, target_cfg, list(cfg.engines))
    more_lines, more = check_states_from(config, cfg.serving)
    lines, findings = lines + more_lines, findings + more
    trained_flags = trained_kwargs(config)
    lines.append(f"chat template: the training data was rendered with chat_template_kwargs {json.dumps(trained_flags)}")
    if cfg.serving.chat_template_kwargs is not None:
        warning = kwargs_warning(trained_flags, cfg.serving.chat_template_kwargs, "serving")
        if warning:
            findings.append(Finding("warning", warning))
    for line in lines:
        logger.info(line)
    for f in findings:  # a finding's level is its record's: errors and warnings go to stderr
        logger.log(logging.ERROR if f.level == "error" else logging.WARNING, f"{f.level.upper()}: {f.text}")
    errors = sum(f.level == "error" for f in findings)
    logger.info(f"eagle3-check: {draft}: {'OK' if not errors else f'{errors} problem(s)'}")
    return 1 if errors else 0


main = entry_point("check", CheckConfig, run_check)

if __name__ == "__main__":
    main()
