"""``eagle3-eval``: speculative decoding with the real target, from the exported directory alone.

    eagle3-eval draft=runs/x/export target=embedded engine=sglang prompts=data_prep/prompts/heldout.jsonl

The draft is built from ``config.json`` + ``model.safetensors`` (embeddings: the target's, as SGLang
does). Which target layers feed it is derived from the config by the chosen engine's rule
(:mod:`eagle3_train.engines.rules`), not from our own metadata, so a config that would make the engine
capture the wrong layers shows up as a low acceptance. Greedy chain of ``k`` draft tokens, or with
``topk`` > 1 an EAGLE-2 tree (SGLang's ``--speculative-eagle-topk``, ``--speculative-num-steps``,
``--speculative-num-draft-tokens``; :mod:`eagle3_train.evaluation.tree`), decoded ``batch_size``
prompts at a time by :class:`eagle3_train.evaluation.decoding.SpecDecoder` (target and draft keep
their KV caches; a verify step is one target forward). Prompt files: :mod:`eagle3_train.core.prompt_files`;
a conversation's later user turns follow the target's own greedy replies to the earlier ones.

Lossless check: every turn is also decoded by plain greedy decoding (batched the same way). At the
first position where the two differ, the reference's top-1 minus top-2 logit margin decides:
``numerical`` at or below ``tie_threshold`` (a near-tie that rounding can flip), else ``diverged`` (exit
status 1). Writes ``report.json``, ``outputs.jsonl`` and ``acceptance.png`` to ``out``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.contract import check_dtype
from eagle3_train.core.dist import resolve_device
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fileio import remove_temporaries, sha256_file
from eagle3_train.core.log import LogConfig
from eagle3_train.core.prompt_files import Conversation, read_conversations
from eagle3_train.core.reasoning import (
    PROMPT_TAIL,
    check_template_kwargs,
    kwargs_warning,
    markers_for,
    reasoning_tokens,
    trained_kwargs,
)
from eagle3_train.core.reports import EvalReport
from eagle3_train.core.stagedir import StageDir, hold_lock
from eagle3_train.engines import registry
from eagle3_train.engines.rules import resolve
from eagle3_train.evaluation.decoding import Counters, Reference, SpecDecoder
from eagle3_train.evaluation.graph_spec import GraphSpecDecoder
from eagle3_train.evaluation.plots import plot_acceptance
from eagle3_train.evaluation.tree import TreeShape
from eagle3_train.serving.card import eval_dir
from eagle3_train.serving.drafts import default_engine, read_draft_dir
from eagle3_train.serving.loading import load_draft_dir
from eagle3_train.targets import (
    chat_template_of,
    eos_ids,
    load_target,
    set_template_kwargs,
    template_kwargs,
    text_config,
)

logger = logging.getLogger(__name__)

REPORT_NAME = "report.json"  # the eval directory's record, written last (eagle3_train.core.stagedir)

# Top-1/top-2 logit margins up to which a first difference counts as numerical: a few units in the
# last place of logits of magnitude ~10-30 in that dtype, plus what batching reorders upstream (bf16
# margins come in steps of 0.125-0.5 there, so a margin of exactly 0.5 is a near-tie too).
TIE_THRESHOLDS = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.5}


@dataclass
class EvalConfig:
    """Options of ``eagle3-eval`` (``conf/eval.yaml``)."""

    draft: str = MISSING  # an exported draft directory (config.json + model.safetensors)
    target: str = "embedded"  # the target (any form load_target takes)
    engine: str | None = None
    """whose rule turns the config's ids into captured layers, and whose forward the draft is computed with (sglang | vllm; null: the first engine that loads the draft's format, among those an export of ours was written for)"""
    prompts: str = MISSING  # JSONL (messages / MT-bench turns / HumanEval prompt / GSM8K question) or a saved dataset
    column: str | None = None  # the field holding each row's prompt (null: recognise the shape)
    out: str | None = None
    """where report.json, outputs.jsonl and acceptance.png go (null: <draft>-eval-<engine> beside the draft, never inside the directory an engine loads; eagle3-export puts its tau on the model card)"""
    k: int = 5  # draft tokens per verify step (chain); a tree's depth unless num_steps says otherwise
    topk: int = 1  # tree drafts: children expanded per frontier node and the frontier's width, SGLang's --speculative-eagle-topk (1: the chain of k)
    num_steps: int | None = None
    """draft steps per verify step = the tree's depth, SGLang's --speculative-num-steps (null: k)"""
    num_draft_tokens: int | None = None
    """tree nodes verified per step, the last accepted token included, SGLang's --speculative-num-draft-tokens (null: num_steps+1, the chain; required with topk>1)"""
    position_bucket: int = 128  # tau by position in the reply: the first bucket's width in tokens; later buckets double (0-128, 128-256, 256-512, ...)
    max_new_tokens: int = 128  # generated tokens per turn
    batch_size: int = 32  # prompts decoded together (1: one at a time)
    decoder: str = "eager"
    """eager: transformers' forward at every step (any family; chains and trees); graph: static caches and one CUDA graph per verify step, speculative and plain greedy alike, so the timed speed-up is not the launch-bound one (dense llama/mistral/qwen2/qwen3 targets, chains). The lossless reference is the model's own forward either way"""
    max_turns: int | None = None  # only the first N user turns of each conversation (null: all)
    limit: int | None = None  # only the first N conversations
    tie_threshold: float | None = None  # lossless check's near-tie margin (null: by dtype, TIE_THRESHOLDS)
    device: str = "auto"  # auto: cuda if present, else cpu
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    cache_dir: str | None = None  # where GGUF targets are converted once
    chat_template: str | None = None  # replaces the tokenizer's template (as in prepare)
    as_trained: bool = False
    """another framework's draft computed as its producer trained it (ModelOpt: the first layer's hidden half normed twice, plain RoPE; SpecForge 0.2.0: the next step takes the pre-norm output) rather than as the engine serves it"""
    chat_template_kwargs: Any = None
    """flags every prompt is rendered with, as an engine's chat_template_kwargs (null: those the draft's data was prepared with, from its config; other flags are used and warned about)"""
    reasoning_markers: list[str] | None = None
    """[start, end] of a reply's reasoning, for tau inside reasoning and inside the answer (null: <think>/</think> or gpt-oss's analysis channel when the chat template names them)"""
    progress: bool | None = None
    """null: a bar on a terminal, else a progress line every logging.progress_every_s seconds; true: a bar always; false: neither"""
    plot: bool = True  # draw acceptance.png (needs the plots extra, matplotlib)
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        check_dtype(self.dtype, auto=True)
        if self.engine is not None:
            registry.engine(self.engine, "export", "engine")
        check_numbers(
            self,
            positive=(
                "k",
                "topk",
                "num_steps",
                "num_draft_tokens",
                "position_bucket",
                "max_new_tokens",
                "batch_size",
                "max_turns",
                "limit",
            ),
            non_negative=("tie_threshold",),
        )
        check_template_kwargs(self.chat_template_kwargs)
        if self.decoder not in ("eager", "graph"):
            raise ConfigError(f"decoder must be eager or graph, got {self.decoder!r}")
        if self.decoder == "graph" and self.topk > 1:
            raise ConfigError("decoder=graph decodes chains (topk=1); tree drafts run with decoder=eager")
        if self.tree is not None:
            self.tree.check(self.depth)
        elif self.num_draft_tokens not in (None, self.depth + 1):
            raise ConfigError(
                f"with topk=1 the draft is the chain of num_steps={self.depth} tokens, verified as "
                f"{self.depth + 1} (num_draft_tokens null or {self.depth + 1}); got num_draft_tokens="
                f"{self.num_draft_tokens} (SGLang aligns it the same way)"
            )

    @property
    def depth(self) -> int:
        """Draft tokens per verify step of the chain, or the tree's depth."""
        return self.num_steps or self.k

    @property
    def tree(self) -> TreeShape | None:
        """The tree's shape with topk > 1, else None (the chain)."""
        if self.topk == 1:
            return None
        if self.num_draft_tokens is None:
            raise ConfigError(
                f"topk={self.topk} drafts a tree: give num_draft_tokens (SGLang's "
                f"--speculative-num-draft-tokens, the nodes verified per step, the last accepted token included)"
            )
        return TreeShape(self.topk, self.num_draft_tokens)


ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


def short_training_warning(config: dict, k: int, tree: bool = False) -> str | None:
    """A warning when the exported draft was trained with fewer TTT steps than the chain (or the
    tree, ``tree``) is deep (``eagle3_train.training.ttt_length`` of its config.json): positions past
    it were never trained and accept less. None when it was trained for k or more, or the config
    does not say."""
    ttt = ((config.get("eagle3_train") or {}).get("training") or {}).get("ttt_length")
    if ttt is None or ttt >= k:
        return None
    drafts, option = (f"trees of num_steps={k}", "num_steps") if tree else (f"chains of k={k}", "k")
    return (
        f"the draft was trained with ttt_length={ttt} but drafts {drafts}: draft positions "
        f"{ttt + 1}..{k} were never trained; train with objective.ttt_length>={k} or evaluate with {option}={ttt}"
    )


def lossless_check(tokens: list[int], reference: Reference, threshold: float) -> dict[str, Any]:
    """Speculative ``tokens`` against plain greedy decoding: ``identical``, or at the first position
    where they differ, ``numerical`` when the reference's top-1/top-2 margin there is at most
    ``threshold`` (a near-tie: low-precision margins come on a grid, so the bound is included), else
    ``diverged``."""
    ref = reference.tokens
    if tokens == ref:
        return {"status": "identical"}
    i = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
    margin = reference.margins[i] if i < len(reference.margins) else None
    return {
        "status": "numerical" if margin is not None and margin <= threshold else "diverged",
        "position": i,
        "margin": margin,
        "threshold": threshold,
        "speculative_token": tokens[i] if i < len(tokens) else None,
        "reference_token": ref[i] if i < len(ref) else None,
    }


@dataclass
class TurnResult:
    """One user turn of one conversation, decoded both ways."""

    conversation: Conversation
    turn: int
    prompt_tokens: int
    tokens: list[int]
    accepted: list[int]
    check: dict[str, Any]
    reply: str
    reasoning: int = 0  # the reply's first tokens that are reasoning (core/reasoning.py)


def acceptance(steps: list[list[int]], k: int) -> dict[str, Any]:
    """τ (tokens per verify step) and acceptance rate per draft position over verify steps' accepted counts."""
    flat = [a for s in steps for a in s]
    reached, hits = [0] * k, [0] * k
    for a in flat:
        for i in range(min(a + 1, k)):
            reached[i] += 1
        for i in range(a):
            hits[i] += 1
    return {
        "tau": (sum(flat) + len(flat)) / max(len(flat), 1),
        "verify_steps": len(flat),
        "acceptance_per_position": [h / r if r else 0.0 for h, r in zip(hits, reached)],
    }


def bucket_edges(position: int, bucket: int) -> tuple[int, int]:
    """The reply-position bucket holding ``position`` (0-based): [0, b), [b, 2b), [2b, 4b), ..."""
    start, end = 0, bucket
    while position >= end:
        start, end = end, 2 * end
    return start, end


REPEAT_NGRAM = 8  # a reply's token repeats when the 8 tokens ending at it already ran earlier in that reply
LOOPING_SHARE = 0.5  # a reply stretch where at least this share of the tokens repeat is reported as looping


def repeated_tokens(tokens: list[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """Per token of a reply: whether the n tokens ending at it occurred earlier in the same reply, i.e.
    the reply runs in a loop there (the first n tokens never do: the n-th closes the first run)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in range(len(tokens)):
        gram = tuple(tokens[i - n + 1 : i + 1]) if i >= n - 1 else None
        out.append(gram in seen)
        if gram is not None:
            seen.add(gram)
    return out


def acceptance_by_position(
    steps: list[list[int]], k: int, bucket: int, replies: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    """τ and acceptance per draft position (:func:`acceptance`) of the verify steps grouped by where
    in the reply each one starts: a reply's first token comes from the prefill, so its verify step i
    produces the tokens from position ``1 + sum(a_j + 1 for j < i)`` on. The same steps as the
    overall figure, regrouped; only buckets that hold some. With ``replies`` (the tokens of each
    reply, in the order of ``steps``) each bucket also has ``repeated_share``: the share of the reply
    tokens at its own positions that repeat (:func:`repeated_tokens`; counted by each token's position,
    where ``tokens`` counts the tokens of the steps that start in the bucket): where it is high, the
    target loops and τ measures how well the draft copies a loop."""
    groups: dict[tuple[int, int], list[int]] = {}
    for accepted in steps:
        position = 1
        for a in accepted:
            groups.setdefault(bucket_edges(position, bucket), []).append(a)
            position += a + 1
    repeats: dict[tuple[int, int], list[bool]] = {}
    for tokens in replies or []:
        for position, repeated in enumerate(repeated_tokens(tokens)):
            repeats.setdefault(bucket_edges(position, bucket), []).append(repeated)
    out = []
    for (start, end), flat in sorted(groups.items()):
        row = {"from": start, "to": end, "tokens": sum(a + 1 for a in flat)} | acceptance([flat], k)
        if replies is not None:
            r = repeats.get((start, end), [])
            row |= {"repeated_share": sum(r) / len(r) if r else 0.0, "tokens_at_positions": len(r)}
        out.append(row)
    return out


def by_region(results: list[TurnResult], k: int, markers: tuple[str, str] | None) -> dict[str, Any] | None:
    """Tau inside reasoning and inside the answer: each verify step counted where its first token
    falls (a reply's first ``reasoning`` tokens are reasoning); None without reasoning markers."""
    if markers is None:
        return None
    steps: dict[str, list[int]] = {"reasoning": [], "answer": []}
    for r in results:
        at = 0
        for a in r.accepted:
            steps["reasoning" if at < r.reasoning else "answer"].append(a)
            at += a + 1
    tokens = {"reasoning": sum(min(r.reasoning, len(r.tokens)) for r in results)}
    tokens["answer"] = sum(len(r.tokens) for r in results) - tokens["reasoning"]
    return {"markers": list(markers)} | {
        region: {"tokens": tokens[region]}
        | (acceptance([flat], k) if flat else {"tau": None, "verify_steps": 0, "acceptance_per_position": None})
        for region, flat in steps.items()
    }


def looping_warnings(buckets: list[dict[str, Any]]) -> list[str]:
    """A warning per reply stretch whose tokens mostly repeat (``repeated_share`` ≥ LOOPING_SHARE)."""
    return [
        f"reply positions {b['from']}-{b['to']}: {b['repeated_share']:.0%} of the {b['tokens_at_positions']} tokens there "
        f"repeat a run of {REPEAT_NGRAM} from earlier in the same reply (the target loops); tau {b['tau']:.2f} there "
        f"measures the draft copying the loop, not predicting new text"
        for b in buckets
        if b.get("repeated_share", 0.0) >= LOOPING_SHARE
    ]


class Evaluator:
    """Loads target + exported draft, decodes every conversation turn by turn, writes the report."""

    def __init__(self, cfg: EvalConfig):
        if cfg.engine is None:  # the draft's format says which engine serves it
            cfg = replace(cfg, engine=default_engine(read_draft_dir(Path(cfg.draft).expanduser())))
        assert cfg.engine is not None  # (named, or the draft's)
        self.cfg, self.engine = cfg, cfg.engine
        if cfg.plot:  # before the target loads, not after the decoding
            optional_import("matplotlib")
        device = resolve_device(cfg.device)
        self.target = load_target(
            cfg.target, cache_dir=cfg.cache_dir, dtype=cfg.dtype, device=str(device), chat_template=cfg.chat_template
        )
        self.draft_dir = Path(cfg.draft).expanduser()
        self.draft, self.dd = load_draft_dir(self.draft_dir, self.target, cfg.engine, cfg.as_trained)
        self.config = self.dd.config
        trained = trained_kwargs(self.config)
        used = trained if cfg.chat_template_kwargs is None else cfg.chat_template_kwargs
        set_template_kwargs(self.target.tokenizer, used)
        flags_warning = kwargs_warning(trained, template_kwargs(self.target.tokenizer), "eagle3-eval")
        self.markers = markers_for(chat_template_of(self.target.tokenizer), cfg.reasoning_markers)
        if (warning := short_training_warning(self.config, cfg.depth, cfg.tree is not None)) is not None:
            logger.warning(f"eagle3-eval: warning: {warning}")
        self.dtype = next(self.target.model.parameters()).dtype
        self.draft.to(device, self.dtype)
        tc = text_config(self.target.config)
        self.context = tc.max_position_embeddings
        resolutions = resolve(self.config, cfg.engine, tc.model_type, tc.num_hidden_layers)
        if not resolutions:
            raise ContractError(
                f"{cfg.engine} serves no EAGLE-3 draft for a {tc.model_type} target (eagle3_train.engines.rules)"
            )
        self.resolution = resolutions[0]  # the engine's default runner
        self.layers = self.resolution.fed  # in the engine's order; N: the last layer's pre-norm output
        if self.resolution.problem is not None:
            raise ContractError(f"{self.resolution.problem}: the engine could not run this draft")
        self.warnings = [flags_warning] if flags_warning else []
        self.capture = self.dd.capture(tc.num_hidden_layers)
        if self.dd.producer != "eagle3_train":
            self.warnings += self._foreign_warnings()
        if self.resolution.pre_norm_final:  # fed as the engine would: tau then shows what serving gets
            how = self.resolution.note or f"an id lands on N={tc.num_hidden_layers}"
            self.warnings.append(
                f"{cfg.engine} feeds the last layer's output before the final norm ({how}); no HF "
                f"index names it and no draft trained here saw it; eval feeds it as the engine would"
            )
        for warning in self.warnings:
            logger.warning(f"eagle3-eval: warning: {warning}")
        if any(k < 0 or k > tc.num_hidden_layers for k in self.layers):
            raise ContractError(
                f"{cfg.engine} would capture HF indices {self.layers}, outside 0..{tc.num_hidden_layers}"
            )
        if len(self.layers) * tc.hidden_size != self.draft.fc.in_features:
            raise ContractError(
                f"{cfg.engine} would capture {len(self.layers)} layers ({self.layers}; read from "
                f"{self.resolution.source}) = width {len(self.layers) * tc.hidden_size}, but fc takes "
                f"{self.draft.fc.in_features}: the engine would fail to run this draft"
            )
        self.eos = eos_ids(self.target.model, self.target.tokenizer)
        self.decoder = SpecDecoder(self.target.model, self.draft, self.layers, cfg.depth, self.eos, cfg.tree)
        self.fast = (  # the timed decoders with decoder=graph; self.decoder's greedy stays the reference
            GraphSpecDecoder(self.target.model, self.draft, self.layers, cfg.depth, self.eos, self.decoder)
            if cfg.decoder == "graph"
            else None
        )
        self.threshold = cfg.tie_threshold if cfg.tie_threshold is not None else TIE_THRESHOLDS.get(self.dtype, 0.0)
        self.out = Path(cfg.out).expanduser() if cfg.out else eval_dir(self.draft_dir, cfg.engine)

    def _foreign_warnings(self) -> list[str]:
        """What eval says of another framework's draft: where it computes otherwise than its producer
        trained, what it leaves unsaid, a capture that differs from the one it records."""
        dd, out = self.dd, []
        how = f"eval computes as {dd.title} trained it (as_trained=true), not as {self.cfg.engine} serves it"
        if not self.cfg.as_trained:
            how = f"eval computes as {self.cfg.engine} does (as_trained=true: as it was trained)"
        out += [f"{dd.title}: {note}; {how}" for note in dd.train_serve_notes()]
        if (w := dd.sliding_window()) is not None and registry.ENGINES[self.engine].honours_sliding_window():
            out.append(
                f"{dd.title}: vLLM attends within a sliding window of {w} tokens; eval attends to the whole "
                f"context (equal while contexts stay under {w - self.cfg.depth} tokens)"
            )
        ids = self.capture.hf_indices
        if ids is not None and sorted(ids) != sorted(self.layers):
            out.append(
                f"{dd.title}: {self.cfg.engine} captures HF {self.layers}, the draft records {sorted(ids)} "
                f"({self.capture.source})"
            )
        elif not self.capture.recorded:
            out.append(f"{dd.title}: the layers it was trained on are {self.capture.source}")
        return out

    def conversations(self) -> list[Conversation]:
        return read_conversations(self.cfg.prompts, self.cfg.column, self.cfg.limit)

    def tokenize(self, conversation: Conversation, turn: int, replies: list[str]) -> list[int]:
        """The chat-templated prompt of one turn; refuses one that cannot fit the target's context."""
        tok = self.target.tokenizer
        ids = tok.apply_chat_template(
            conversation.messages(turn, replies),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **template_kwargs(tok),
        )["input_ids"]
        if len(ids) + self.cfg.max_new_tokens + self.cfg.depth + 1 > self.context:
            raise BadInputError(
                f"{conversation.source}: turn {turn + 1} is {len(ids)} tokens; with max_new_tokens="
                f"{self.cfg.max_new_tokens} and k={self.cfg.depth} it does not fit the target's context of {self.context}"
            )
        return ids

    def reply(self, tokens: list[int]) -> str:
        """The text of a reply, as the next turn's assistant message (without its end-of-turn)."""
        if tokens and tokens[-1] in self.eos:
            tokens = tokens[:-1]
        return self.target.tokenizer.decode(tokens)

    def decode(self, conversations: list[Conversation]) -> tuple[list[TurnResult], dict[str, float]]:
        """Every turn of every conversation, speculative and plain greedy; turn t+1's prompts hold
        the greedy replies (the target's own) to turns 1..t."""
        replies: list[list[str]] = [[] for _ in conversations]
        results: list[TurnResult] = []
        seconds = {"speculative": 0.0, "greedy": 0.0, "greedy_tokens": 0.0, "greedy_as_reference": 0.0}
        turns = max(len(c.turns) for c in conversations)
        for turn in range(min(turns, self.cfg.max_turns or turns)):
            idx = [i for i, c in enumerate(conversations) if len(c.turns) > turn]
            prompts = [self.tokenize(conversations[i], turn, replies[i]) for i in idx]
            if self.fast is not None and turn == 0:  # untimed: the first use of each kernel and library
                self.fast.speculative(prompts[:1], min(8, self.cfg.max_new_tokens), 1)
                self.fast.greedy(prompts[:1], min(8, self.cfg.max_new_tokens), 1)
                self.fast.counters = Counters()
            timed = self.fast or self.decoder
            start = time.perf_counter()
            spec = timed.speculative(prompts, self.cfg.max_new_tokens, self.cfg.batch_size)
            seconds["speculative"] += time.perf_counter() - start
            start = time.perf_counter()
            plain: list[Any] = timed.greedy(prompts, self.cfg.max_new_tokens, self.cfg.batch_size)
            seconds["greedy"] += time.perf_counter() - start
            seconds["greedy_tokens"] += sum(len(p.tokens) for p in plain)
            refs: list[Reference] = (  # untimed with decoder=graph: the reference at a batch that keeps it short
                self.decoder.greedy(prompts, self.cfg.max_new_tokens, max(self.cfg.batch_size, 32))
                if self.fast is not None
                else plain
            )
            seconds["greedy_as_reference"] += sum(p.tokens == r.tokens for p, r in zip(plain, refs))
            for i, prompt, s, r in zip(idx, prompts, spec, refs):
                replies[i].append(self.reply(r.tokens))
                results.append(
                    TurnResult(
                        conversations[i],
                        turn,
                        len(prompt),
                        s.tokens,
                        s.accepted,
                        lossless_check(s.tokens, r, self.threshold),
                        replies[i][-1],
                        reasoning_tokens(self.target.tokenizer, prompt[-PROMPT_TAIL:], s.tokens, self.markers)
                        if self.markers
                        else 0,
                    )
                )
            fault_point("eval.turn")
            if self.cfg.progress is not False:
                logger.info(
                    f"eagle3-eval: turn {turn + 1}: {len(idx)} prompts, speculative {seconds['speculative']:.1f} s, "
                    f"greedy {seconds['greedy']:.1f} s so far"
                )
        return results, seconds

    def request(self) -> dict[str, Any]:
        """What decides the report: options (not where it goes), the draft files, the target."""
        opts = {k: v for k, v in config_dict(self.cfg).items() if k not in ("out", "progress", "plot", "logging")}
        files = {p.name: sha256_file(p) for p in (self.draft_dir / "config.json", *self.dd.files)}
        return {"options": opts, "draft": files, "target": self.target.identity.to_dict()}

    def run(self) -> dict[str, Any]:
        """Decode, write ``outputs.jsonl``, ``acceptance.png`` and the report (last), log the
        summary; a report of these very options and draft is returned as it stands."""
        self.out.mkdir(parents=True, exist_ok=True)
        hold_lock(self.out, "evaluation")  # one eval to out= at a time: a second is refused, naming the first
        remove_temporaries(self.out)  # a killed eval's unrenamed report
        out = StageDir(self.out, "eval", self.request(), record=REPORT_NAME)
        old = out.finished(replace=True)  # a report of other options or another draft is redone
        if old is not None:
            logger.info(f"eagle3-eval: {self.out / REPORT_NAME} is up to date (tau {old['tau']:.2f}); nothing to do")
            return old
        conversations = self.conversations()
        results, seconds = self.decode(conversations)
        counts, cases = lossless_summary(results)
        report = self.report(len(conversations), results, seconds, counts, cases)
        self.out.mkdir(parents=True, exist_ok=True)
        write_outputs(results, self.out / "outputs.jsonl")
        if self.cfg.plot:
            plot_acceptance(report, self.out / "acceptance.png")
        report = out.write_manifest(report)
        self._log_summary(report, counts, cases)
        return report

    def report(
        self,
        conversations: int,
        results: list[TurnResult],
        seconds: dict[str, float],
        counts: dict[str, int],
        cases: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The report's fields (:class:`eagle3_train.core.reports.EvalReport`) of these results."""
        k, tokens = self.cfg.depth, sum(len(r.tokens) for r in results)
        overall = acceptance([r.accepted for r in results], k)
        by_position = acceptance_by_position(
            [r.accepted for r in results], k, self.cfg.position_bucket, [r.tokens for r in results]
        )
        return EvalReport(
            engine=self.engine,
            rule=self.resolution.rule.versions,
            ids_read_from=self.resolution.source,
            ids=self.resolution.ids,
            captured_hf_indices=self.resolution.hf_indices,
            fed=self.layers,
            pre_norm_final=self.resolution.pre_norm_final,
            warnings=self.warnings,
            looping=looping_warnings(by_position),  # reply stretches where the target repeats itself
            trained_hf_indices=self.capture.hf_indices if self.capture.recorded else None,
            trained_ttt_length=self.config.get("eagle3_train", {}).get("training", {}).get("ttt_length"),
            conversations=conversations,
            prompts=len(results),
            k=k,
            tokens=tokens,
            tree=None
            if self.cfg.tree is None
            else {"topk": self.cfg.topk, "num_steps": k, "num_draft_tokens": self.cfg.num_draft_tokens},
            verify_steps=overall["verify_steps"],
            tau=overall["tau"],
            acceptance_per_position=overall["acceptance_per_position"],
            by_reply_position=by_position,
            categories=by_category(results, k),
            prompt_lengths=by_prompt_length(results, k),
            turns=by_turn(results, k),
            by_region=by_region(results, k, self.markers),
            chat_template_kwargs=template_kwargs(self.target.tokenizer),
            draft_format=self._draft_format(),
            lossless="diverged" if counts["diverged"] else "numerical" if counts["numerical"] else "identical",
            lossless_counts=counts,
            lossless_cases=cases,
            tie_threshold=self.threshold,
            batch_size=self.cfg.batch_size,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.decoder.device),
            decoder=self.cfg.decoder,
            **self._timing(tokens, seconds),
            config=config_dict(self.cfg),
        ).to_dict()

    def _draft_format(self) -> dict[str, Any]:
        """Who wrote the draft, what it records, and the forward flags eval computed it with."""
        return {
            "producer": self.dd.producer,
            "version": self.dd.version,
            "trained_hf_indices": self.capture.hf_indices,
            "trained_from": self.capture.source,
            "recorded": self.capture.recorded,
            "flags": (self.dd.trained_flags() if self.cfg.as_trained else self.dd.flags(self.engine)).changed(),
            "as_trained": self.cfg.as_trained,
        }

    def _timing(self, tokens: int, seconds: dict[str, float]) -> dict[str, Any]:
        """The report's timing fields: both decoders' seconds and rates, and the eager decoder's split."""
        c = (self.fast or self.decoder).counters
        return dict(
            timing=(
                f"transformers eager execution, {self.cfg.batch_size} prompts at a time, both decoders"
                if self.fast is None
                else f"static caches, a CUDA graph per verify step on a GPU, {self.cfg.batch_size} prompts at a "
                f"time, both decoders (graph capture included)"
            ),
            speculative_seconds=seconds["speculative"],
            greedy_seconds=seconds["greedy"],
            speculative_tokens_per_s=tokens / max(seconds["speculative"], 1e-9),
            greedy_tokens_per_s=seconds["greedy_tokens"] / max(seconds["greedy"], 1e-9),
            speedup=seconds["greedy"] / max(seconds["speculative"], 1e-9),
            # the timed greedy decoder's replies equal to the reference's (decoder=graph: its own kernels;
            # in bf16 a near tie may part them, in fp32 none may)
            timed_greedy_equals_reference=int(seconds["greedy_as_reference"]),
            # the eager decoder's split of its time and of its draft's work (a graph runs a step as a whole)
            target_seconds=c.target_seconds if self.fast is None else None,
            draft_seconds=c.draft_seconds if self.fast is None else None,
            draft_positions_per_verify_step=c.draft_positions / max(c.row_rounds, 1) if self.fast is None else None,
        )

    def _log_summary(self, report: dict[str, Any], counts: dict[str, int], cases: list[dict[str, Any]]) -> None:
        """One line of the figures, then a warning per looping stretch and per output that differs."""
        k = self.cfg.depth
        drafts = (
            f"tree topk={self.cfg.topk} num_steps={k} num_draft_tokens={self.cfg.num_draft_tokens}"
            if self.cfg.tree
            else f"chain k={k}"
        )
        stretches = ", ".join(
            f"{b['from']}-{b['to']}: {b['tau']:.2f} ({b['repeated_share']:.0%} repeated)"
            for b in report["by_reply_position"]
        )
        logger.info(
            f"eagle3-eval ({self.cfg.engine}: {self.resolution.describe()} from {self.resolution.source}; "
            f"{drafts}): tau {report['tau']:.2f} over {report['verify_steps']} verify steps, acceptance per "
            f"{'depth' if self.cfg.tree else 'position'} {[round(p, 3) for p in report['acceptance_per_position']]}; "
            f"tau by reply position [{stretches}]; "
            + (
                "; ".join(
                    f"{where} {region[key]['tau']:.2f} ({region[key]['tokens']} tokens)"
                    for key, where in (("reasoning", "inside reasoning"), ("answer", "in the answer"))
                    if region[key]["tau"] is not None
                )
                + "; "
                if (region := report["by_region"])
                else ""
            )
            + f"per category "
            f"{ {cat: round(v['tau'], 2) for cat, v in report['categories'].items()} }; per prompt length "
            f"{ {span: round(v['tau'], 2) for span, v in report['prompt_lengths'].items()} }; lossless "
            f"{report['lossless']} {counts}; {report['speculative_tokens_per_s']:.0f} tokens/s speculative, "
            f"{report['speedup']:.2f}x the speed of plain greedy (batch {self.cfg.batch_size}) -> {self.out}"
        )
        for text in report["looping"]:
            logger.warning(f"eagle3-eval: warning: {text}")
        for case in cases:
            logger.warning(
                f"eagle3-eval: {case['status']}: {case['source']} turn {case['turn']} differs at token "
                f"{case['position']} (reference margin {case['margin']}, threshold {case['threshold']})"
            )


def lossless_summary(results: list[TurnResult]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """How many turns came out identical, numerical and diverged, and each that was not identical."""
    counts = {s: sum(r.check["status"] == s for r in results) for s in ("identical", "numerical", "diverged")}
    cases = [
        {"source": r.conversation.source, "turn": r.turn + 1} | r.check
        for r in results
        if r.check["status"] != "identical"
    ]
    return counts, cases


def by_category(results: list[TurnResult], k: int) -> dict[str, dict[str, Any]]:
    """Prompts, tokens, τ and acceptance per position of each prompt category."""
    categories = sorted({r.conversation.category for r in results})
    groups = {c: [r for r in results if r.conversation.category == c] for c in categories}
    return {
        cat: {"prompts": len(rs), "tokens": sum(len(r.tokens) for r in rs)} | acceptance([r.accepted for r in rs], k)
        for cat, rs in groups.items()
    }


# prompt tokens -> the bucket eval reports τ in: agents and RAG send prompts of thousands of tokens,
# where a draft trained on short conversations has rarely seen a long context
LENGTH_EDGES = (256, 1024, 2048, 4096, 8192, 16384, 32768)


def length_bucket(tokens: int) -> str:
    """The prompt-length bucket of a turn's prompt (``<256``, ``256-1k``, ..., ``>=32k``)."""
    name = lambda n: f"{n // 1024}k" if n >= 1024 else str(n)  # noqa: E731
    low = 0
    for edge in LENGTH_EDGES:
        if tokens < edge:
            return f"<{name(edge)}" if low == 0 else f"{name(low)}-{name(edge)}"
        low = edge
    return f">={name(low)}"


def by_prompt_length(results: list[TurnResult], k: int) -> dict[str, dict[str, Any]]:
    """Prompts, tokens, τ and acceptance per position of each prompt-length bucket (the prompt
    each turn was decoded after, earlier turns and replies included), shortest first."""
    order = {length_bucket(e - 1): i for i, e in enumerate((*LENGTH_EDGES, 10**9))}
    groups: dict[str, list[TurnResult]] = {}
    for r in results:
        groups.setdefault(length_bucket(r.prompt_tokens), []).append(r)
    return {
        span: {"prompts": len(rs), "tokens": sum(len(r.tokens) for r in rs)} | acceptance([r.accepted for r in rs], k)
        for span, rs in sorted(groups.items(), key=lambda item: order[item[0]])
    }


def by_turn(results: list[TurnResult], k: int) -> dict[str, float]:
    """τ of each user turn ("1", "2", ...)."""
    return {
        str(t + 1): acceptance([r.accepted for r in results if r.turn == t], k)["tau"]
        for t in sorted({r.turn for r in results})
    }


def write_outputs(results: list[TurnResult], path: Path) -> None:
    """``outputs.jsonl``: each turn's tokens, accepted counts, lossless status and reply, a line each."""
    with path.open("w") as f:
        for r in results:
            row = {
                "source": r.conversation.source,
                "category": r.conversation.category,
                "turn": r.turn + 1,
                "prompt_tokens": r.prompt_tokens,
                "tokens": r.tokens,
                "accepted": r.accepted,
                "lossless": r.check["status"],
                "reply": r.reply,
            }
            f.write(json.dumps(row) + "\n")


def run_eval(cfg: EvalConfig) -> int:
    """``eagle3-eval``: the exit status is 1 when some output diverged from plain greedy decoding."""
    return 1 if Evaluator(cfg).run()["lossless"] == "diverged" else 0


main = entry_point("eval", EvalConfig, run_eval)

if __name__ == "__main__":
    main()
