"""``eagle3-check``: what will each engine capture for this draft, and is it what it was trained on?

    eagle3-check draft=runs/x/export target=meta-llama/Llama-3.1-8B-Instruct
    eagle3-check draft=some/third_party_draft target=/models/target/config.json trained=[2,16,29]

Works on any EAGLE-3 draft directory. For each engine runner (the engine's default runner first:
vLLM 0.33's V2) it prints where the ids are read, the HF indices captured, and the trained indices
(from the draft's ``eagle3_train`` block, or ``trained=`` for third-party drafts); it flags silent
fallbacks (no key where the engine reads, so the engine default), a draft whose ``fc`` SGLang would
skip, a forward flag an engine version ignores or computes otherwise than trained, ``d2t``
problems, and weights the engines would not load.

Which engines it judges: ``serving.engine`` (or ``engines=``) when named, each of which must serve
the draft; else the engines our export was written for, each of which must; else (another
framework's draft) every engine, each on its own: the draft passes where one can serve it. Exits 1 on
any mismatch or problem of an engine it must serve with (or of the draft itself), 0 otherwise.
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
from eagle3_train.engines.heads import MEANING, DraftForward
from eagle3_train.engines.rules import fc_skipped, foreign_weights_text, resolve, rules_for, unloadable_weights
from eagle3_train.serving.drafts import OURS, SPECULATORS, DraftDir, read_draft_dir
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
    engines: list[str] | None = None
    """engines that must serve the draft (any with layer-id rules: sglang, vllm, trtllm; null: serving.engine if set, else those our export was written for, else each engine on its own)"""
    cache_dir: str | None = None  # where GGUF targets are converted once
    serving: ServingConfig = field(default_factory=ServingConfig)
    """how the draft will be served (serving.engine=vllm serving.quantization=fp8 ...): compared with what computed the states it trained on"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        check_template_kwargs(self.serving.chat_template_kwargs, "serving.chat_template_kwargs")
        known = registry.names("rules")
        named = [self.serving.engine] if self.serving.engine is not None else []
        unknown = [e for e in (self.engines or []) + named if e not in known]
        if unknown:
            raise ConfigError(f"unknown engines {unknown}; known: {known}")
        if named and self.engines is not None and named[0] not in self.engines:
            raise ConfigError(f"serving.engine={named[0]} is not among engines={self.engines}")


ConfigStore.instance().store(name="check_schema", node=CheckConfig)


@dataclass
class Finding:
    level: str  # "error" (exit 1) or "warning"
    text: str
    engines: tuple[str, ...] = ()  # the engines it concerns (empty: the draft, whatever serves it)


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
    findings = [Finding("error", r, (e,)) for e in engines if (r := dd.refusal(e, fc_width)) is not None]
    findings += [Finding("error", p, (e,)) for e, p in dd.weight_problems() if e in engines]
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
        start = len(findings)  # this engine's findings, tagged with it below
        _engine_findings(config, tensors, tc, trained, engine, lines, findings)
        for f in findings[start:]:
            f.engines = (engine,)
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


def _engine_findings(
    config: dict,
    tensors: dict[str, torch.Tensor],
    tc: Any,
    trained: list[int] | None,
    engine: str,
    lines: list[str],
    findings: list[Finding],
) -> None:
    """The report lines and findings of one engine: what each runner captures, against ``trained``."""
    n, mt = tc.num_hidden_layers, tc.model_type
    if not rules_for(engine, mt):
        e = registry.ENGINES[engine]
        # an engine that refuses the target at load fails for sure; one whose code was not read may not
        refused = e.serves is not None and mt not in e.serves
        findings.append(Finding("error" if refused else "warning", e.unserved(mt)))
        return
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
        Finding("warning", f"{e.title}: {clash}: serve with --dtype {draft} (or export dtype={target})", (e.name,))
        for e in (registry.ENGINES[name] for name in engines)
        if (clash := e.dtype_clash(draft, target)) is not None
    ]


def _check_attention(layer: dict, target_cfg: Any, engines: list[str]) -> list[Finding]:
    """A warning per engine that plans the draft's attention with the target's shape
    (``Engine.attention_planned_by_target``) where the draft's layer is shaped otherwise."""
    draft, target = attention_shape(layer), attention_shape(text_config(target_cfg))
    return [
        Finding("warning", f"{e.title}: {clash}", (e.name,))
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
    t2d = tensors.get("t2d")
    # A zero d2t is also what a map never filled holds (speculators' buffers start as zeros, with an
    # empty t2d). It is the trained map when t2d, built with it, marks target ids 0..n-1 (a vocab
    # chosen from few distinct tokens is padded with the lowest ids) and no others.
    confirmed = t2d is not None and t2d.numel() == v and torch.equal(t2d.bool().nonzero().squeeze(1), ids)
    if len(d2t) < v and bool((d2t == 0).all()) and not confirmed:
        empty = t2d is not None and not bool(t2d.bool().any())
        out.append(
            Finding(
                "error",
                f"d2t is all zeros{' and t2d is empty' if empty else ''}: the draft vocab would be target ids "
                f"0..{len(d2t) - 1}, {'a map never filled' if empty else 'almost surely not the trained map'}",
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


def flag_findings(dd: DraftDir, engines: list[str], version: str | None = None) -> tuple[list[str], list[Finding]]:
    """Each engine version's forward flags (:mod:`eagle3_train.engines.heads`) against those the head
    was trained with (ours: its export's record; another framework's: its config's), for the engines
    that load its format: an error per flag one ignores or computes otherwise, naming the versions
    and keys; and for ours, a flag whose norm the weights lack."""
    trained = dd.trained_flags() if dd.producer == OURS else dd.written_flags()
    rows = [r for e in engines if registry.ENGINES[e].loads(dd.producer == SPECULATORS)
            for r in registry.ENGINES[e].forwards_for(version)]  # fmt: skip
    grouped: dict[str, list[DraftForward]] = {}
    for row in rows:
        for flag in row.refusal(trained, dd.config, dd.producer == SPECULATORS):
            grouped.setdefault(_flag_text(dd, row, flag), []).append(row)
    findings = [
        Finding("error", text.format(who=_versions(group)), tuple(dict.fromkeys(r.engine for r in group)))
        for text, group in grouped.items()
    ]
    lines = []
    ours, first = {dd.our_name(n) for n in dd.names}, rows[0] if rows else None
    for flag in trained.changed():
        if first is None or flag not in first.reads:
            continue
        read = first.reads[flag]
        weight = read.weight.format(i=0).removesuffix(".weight")
        if (
            dd.producer == OURS
            and read.weight
            and not any(n == f"{flag}.weight" or n.startswith(f"{flag}.") for n in ours)
        ):
            findings.append(Finding("error", f"config.json sets {read.top_key} but the weights hold no {weight}"))
        elif not grouped:
            lines.append(f"forward: {MEANING[flag]} ({weight + ', ' if read.weight else ''}{read.top_key}), as trained"
                         + (f" with model.{flag}" if dd.producer == OURS else ""))  # fmt: skip
    return lines, findings


def _flag_text(dd: DraftDir, row: DraftForward, line: str) -> str:
    """A refusal line of :meth:`DraftForward.refusal` as a finding's text, with ``{who}`` for the
    engine versions that share it (ours: said against the training options)."""
    flag = next(f for f in row.reads if f" {f}" in line)
    read, text = row.reads[flag], line.removeprefix(row.name + " ")
    if dd.producer != OURS or not read.keys:
        return "{who} " + text
    norm = f" (its norm is {read.weight.format(i=0)})" if read.weight else ""
    where = (f"sets {read.top_key} neither at its top level nor in eagle_config" if len(read.keys) > 1
             else f"does not set {read.where()}")  # fmt: skip
    if "which the head was not trained with" in text:
        return f"config.json sets {read.top_key} but the head was not trained with model.{flag}: {{who}} would compute it; export the run again"
    return f"the head was trained with model.{flag}{norm}, but config.json {where}: {{who}} would serve it without; export the run again"


def _versions(rows: list[DraftForward]) -> str:
    """``sglang 0.5.17, 0.5.23 and vllm 0.26.0, 0.33.0``."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r.engine, []).append(r.version)
    return " and ".join(f"{e} {', '.join(vs)}" for e, vs in by.items())


def judged(cfg: CheckConfig, dd: DraftDir) -> tuple[list[str], bool]:
    """The engines check judges, and whether each must serve the draft (else: any one will do):
    those named (``serving.engine``, ``engines=``), else those our export was written for, else
    every engine export writes for, each on its own."""
    if cfg.serving.engine is not None:
        return [cfg.serving.engine], True
    if cfg.engines is not None:
        return list(cfg.engines), True
    recorded = (dd.config.get("eagle3_train") or {}).get("engines") if dd.producer == OURS else None
    if recorded:
        return [e for e in recorded if e in registry.ENGINES], True
    return registry.names("export"), dd.producer == OURS


def verdict(findings: list[Finding], engines: list[str], every: bool) -> tuple[list[Finding], list[str]]:
    """The findings as they count, and the engines that can serve the draft: with ``every`` each
    engine's errors count; else, where some engine has none, the others' become warnings (that
    engine cannot serve it) and the draft passes."""
    failing = {e for f in findings if f.level == "error" for e in f.engines}
    serving = [e for e in engines if e not in failing]
    if every or not serving:
        return findings, serving
    return [
        Finding("warning", f"{' and '.join(f.engines)} cannot serve it: {f.text}", f.engines)
        if f.level == "error" and f.engines and not set(f.engines) & set(serving)
        else f
        for f in findings
    ], serving


def draft_findings(
    cfg: CheckConfig, dd: DraftDir, target_cfg: Any, engines: list[str]
) -> tuple[list[str], list[Finding]]:
    """Report lines and findings for one draft directory, for ``engines``."""
    config, tensors, names = dd.config, _vocab_tensors(dd), {dd.our_name(n) for n in dd.names}
    head: list[str] = []
    foreign: list[Finding] = []
    trained = list(cfg.trained) if cfg.trained is not None else None
    if dd.producer != OURS:
        fc = tensors.get("fc.weight")
        head, foreign = foreign_findings(dd, engines, None if fc is None else fc.shape[1])
        if trained is None:
            capture = dd.capture(text_config(target_cfg).num_hidden_layers)
            head.append(f"trained on: HF {capture.hf_indices}, {capture.source}")
            trained = capture.hf_indices if capture.recorded else None
    elif trained is None:
        trained = config.get("eagle3_train", {}).get("capture", {}).get("aux_indices")
    flag_lines, flag_errors = flag_findings(dd, engines, cfg.serving.version if cfg.serving.engine else None)
    # weights the flags account for; another framework's that an engine loads and never applies (said
    # once, by weight_problems); ours of a trained flag the config lost (said once, by flag_findings)
    names -= dd.extra_weights()
    if dd.producer != OURS:
        names -= {n for e in dd.loaders() for n in dd.skipped_by(e)}
    else:
        names -= {n for n in names for f in dd.trained_flags().changed() if n.split(".")[0] == f}
    lines, findings = check(config, tensors, target_cfg, trained, engines, names)
    findings = foreign + flag_errors + findings + _check_attention(dd.layer, target_cfg, engines)
    return head + flag_lines + lines, findings


def run_check(cfg: CheckConfig) -> int:
    draft = Path(cfg.draft).expanduser()
    dd = read_draft_dir(draft)
    target_cfg = target_config(cfg.target, cfg.cache_dir)
    engines, every = judged(cfg, dd)
    if cfg.serving.engine and cfg.serving.version:
        e = registry.ENGINES[cfg.serving.engine]
        if e.forwards and cfg.serving.version not in [r.version for r in e.forwards]:
            logger.warning(
                f"{e.name} {cfg.serving.version}: its draft loader was not read; judged against the versions read "
                f"({', '.join(r.version for r in e.forwards)})"
            )
    lines, findings = draft_findings(cfg, dd, target_cfg, engines)
    more_lines, more = check_states_from(dd.config, cfg.serving)
    lines, findings = lines + more_lines, findings + more
    trained_flags = trained_kwargs(dd.config)
    lines.append(f"chat template: the training data was rendered with chat_template_kwargs {json.dumps(trained_flags)}")
    if cfg.serving.chat_template_kwargs is not None:
        warning = kwargs_warning(trained_flags, cfg.serving.chat_template_kwargs, "serving")
        if warning:
            findings.append(Finding("warning", warning))
    findings, serving = verdict(findings, engines, every)
    if not every and serving:
        lines.append(f"serve with: {', '.join(serving)} (each engine judged on its own; name one with serving.engine=)")
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
