"""Regeneration: the target writes the assistant turns itself, turn by turn.

EAGLE-3 and SpecForge report this as the largest lever on acceptance: a draft learns the target's
own distribution, not the one of whoever wrote the dataset. Each conversation's assistant slots
(every existing assistant turn, plus a reply to every user turn that has none, so a file of
user prompts -- multi-turn ones too -- becomes conversations) are filled in order; slot ``s``
of all conversations is generated in length-sorted batches before slot ``s+1``, since a later
turn's prompt contains the earlier generated turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from data_prep.chat import render_text
from data_prep.conversations import Conversation
from data_prep.graph_decode import CACHE_SHARE
from data_prep.served_regen import ServedRegenConfig, served_generate_batch
from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.log import progress_bar
from eagle3_train.core.reasoning import PROMPT_TAIL, markers_for, reasoning_tokens
from eagle3_train.engines import registry
from eagle3_train.targets import chat_template_of

BATCHING = ("padded", "static", "continuous", "graph")
STATIC_WIDTH_STEP = 64  # regen.batching=static: prompt widths are rounded up to this (fewer compiled shapes)


@dataclass
class RegenConfig:
    """How the target regenerates assistant turns (``regenerate=true``)."""

    max_new_tokens: int = 512  # longest reply generated for one turn
    do_sample: bool = False  # false: greedy; true: sample with temperature/top_p
    temperature: float = 0.7  # sampling temperature (do_sample=true only)
    top_p: float = 0.95  # nucleus sampling mass (do_sample=true only)
    batch_size: int = 32  # prompts generated together
    chunk_size: int = 1024  # conversations per resumable chunk written under <out>/regen/
    backend: str = "hf"
    """hf: transformers in this process; an engine (vllm | sglang): the engine serving the target at server.url"""
    batching: str = "padded"  # hf only. padded: model.generate on left-padded, length-sorted batches of batch_size; static: the same with a static KV cache (generate compiles it on GPUs); continuous: transformers' continuous batching (model.generate_batch: paged cache, finished replies make room for new ones); graph: our own decode loop on a static cache, one CUDA graph per batch (dense llama/mistral/qwen2/qwen3; data_prep.graph_decode)
    server: ServedRegenConfig = field(default_factory=ServedRegenConfig)  # backend=vllm|sglang only
    memory_share: float = CACHE_SHARE
    """batching=graph only: the share of the GPU's memory, less the weights, that one batch's buffers may take (split among this node's ranks on the GPU); lower it when the GPU is shared with other work (an engine, a trainer). Batches split by it, so sampled replies change with it"""
    cut_in_reasoning: str = "drop"
    """a reply that hits max_new_tokens inside its reasoning (opened, never closed: core/reasoning.py's markers, found from the chat template): drop its conversation (a bad row, cut_in_reasoning) or keep it; counted in the manifest either way"""

    def __post_init__(self) -> None:
        registry.engine(self.backend, "regenerate", "regen.backend")
        if self.cut_in_reasoning not in ("drop", "keep"):
            raise ConfigError(f"regen.cut_in_reasoning must be drop or keep, got {self.cut_in_reasoning!r}")
        if self.batching not in BATCHING:
            raise ConfigError(f"regen.batching must be one of {BATCHING}, got {self.batching!r}")
        check_numbers(self, "regen.", positive=("max_new_tokens", "batch_size", "chunk_size"))
        if not 0 < self.memory_share <= 1:  # NaN fails too
            raise ConfigError(f"regen.memory_share must be in (0, 1], got {self.memory_share}")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ConfigError("regen.temperature must be > 0 and regen.top_p in (0, 1] when sampling")


def assistant_slots(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """Messages with an empty assistant turn after every user turn that has no reply, and the
    positions of all assistant turns (the slots to fill, in order)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        out.append(dict(m))
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] in ("user", "tool") and following not in ("assistant", "tool"):
            out.append({"role": "assistant", "content": ""})
    return out, [i for i, m in enumerate(out) if m["role"] == "assistant"]


@torch.no_grad()
def regenerate(
    model: Any,
    tokenizer: Any,
    conversations: list[Conversation],
    cfg: RegenConfig,
    *,
    eos_ids: list[int],
    pad_id: int,
    progress: bool | None = True,
    seed: int | None = None,
) -> tuple[list[Conversation], int]:
    """Return the conversations with every assistant slot written by ``model``.

    Returns:
        The regenerated conversations (same order, same sources) and the number of turns that hit
        ``max_new_tokens`` before an end-of-turn token.
    """
    work = [assistant_slots(c.messages) for c in conversations]
    markers = markers_for(chat_template_of(tokenizer), None)
    cut_in_reasoning: set[int] = set()
    unfinished = 0
    n_turns = sum(len(slots) for _, slots in work)
    bar = progress_bar(total=n_turns, desc="regenerate", unit="turn", show=progress)
    for s in range(max((len(slots) for _, slots in work), default=0)):
        todo = [ci for ci, (_, slots) in enumerate(work) if len(slots) > s]
        prompts = []
        for ci in todo:
            messages, slots = work[ci]
            text = render_text(tokenizer, messages[: slots[s]], conversations[ci].source, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        replies, hit_limit = generate_sorted(
            model, prompts, cfg, eos_ids, pad_id, bar=bar, seed=None if seed is None else seed * 1009 + s
        )
        unfinished += hit_limit
        for ci, ids, prompt in zip(todo, replies, prompts):
            messages, slots = work[ci]
            if (
                markers
                and len(ids) >= cfg.max_new_tokens
                and reasoning_tokens(tokenizer, prompt[-PROMPT_TAIL:], ids, markers) == len(ids)
            ):
                cut_in_reasoning.add(ci)
            # special tokens stay (e.g. <think>): the text must re-tokenise to what the target wrote
            messages[slots[s]]["content"] = tokenizer.decode(ids, skip_special_tokens=False).strip()
    bar.close()
    out = [
        Conversation(m, c.source, dict(c.meta) | ({"cut_in_reasoning": True} if i in cut_in_reasoning else {}))
        for i, ((m, _), c) in enumerate(zip(work, conversations))
    ]
    return out, unfinished


def generate_sorted(
    model: Any,
    prompts: list[list[int]],
    cfg: RegenConfig,
    eos_ids: list[int],
    pad_id: int,
    bar: Any = None,
    seed: int | None = None,
) -> tuple[list[list[int]], int]:
    """Generate one reply per prompt in batches of ``cfg.batch_size`` prompts of similar length
    (less padding); the replies come back in the order of ``prompts``. ``bar`` (a tqdm) advances
    by one per prompt. The batches depend only on ``prompts`` and ``cfg``, so a seeded run is
    repeatable wherever it runs. With ``cfg.backend`` vllm or sglang, ``model`` is unused: every
    prompt is one request to the engine (it batches them itself), sampled with a per-prompt seed
    derived from ``seed``."""
    if not registry.ENGINES[cfg.backend].in_process:
        sampling = dict(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=cfg.do_sample,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=seed,
        )
        return served_generate_batch(prompts, cfg.server, sampling, eos_ids, cfg.backend, bar=bar)
    if cfg.batching == "continuous":
        continuous = generate_continuous(model, prompts, cfg, eos_ids, pad_id, seed)
        if bar is not None:
            bar.update(len(prompts))
        return continuous
    if cfg.batching == "graph":
        from data_prep.graph_decode import generate_graph

        return cut_replies(generate_graph(model, prompts, cfg, eos_ids, pad_id, bar=bar), eos_ids)
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # stable: ties keep their order
    replies: list[list[int]] = [[] for _ in prompts]
    unfinished = 0
    for b in range(0, len(order), cfg.batch_size):
        batch = order[b : b + cfg.batch_size]
        out, hit_limit = generate_batch(model, [prompts[i] for i in batch], cfg, eos_ids, pad_id, device)
        unfinished += hit_limit
        for i, ids in zip(batch, out):
            replies[i] = ids
        if bar is not None:
            bar.update(len(batch))
    return replies, unfinished


def generate_batch(
    model: Any,
    prompts: list[list[int]],
    cfg: RegenConfig,
    eos_ids: list[int],
    pad_id: int,
    device: torch.device,
) -> tuple[list[list[int]], int]:
    """Generate one reply per prompt (left-padded batch); return the reply ids up to, not
    including, the first end-of-turn token, and how many replies hit ``max_new_tokens``.

    With ``cfg.batching=static`` the KV cache is transformers' static cache, which ``generate``
    compiles on a GPU (CUDA graphs): to keep to few compiled shapes the batch is filled up to
    ``cfg.batch_size`` rows (copies of the last prompt, discarded) and the width rounded up to a
    multiple of STATIC_WIDTH_STEP (more left padding, which the attention mask hides)."""
    static = cfg.batching == "static"
    rows = [*prompts, *[prompts[-1]] * (cfg.batch_size - len(prompts))] if static else prompts
    width = max(len(p) for p in prompts)
    if static:
        width = -(-width // STATIC_WIDTH_STEP) * STATIC_WIDTH_STEP
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p) if cfg.do_sample else {}
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=cfg.max_new_tokens,
        do_sample=cfg.do_sample,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **({"cache_implementation": "static"} if static else {}),
        **sampling,
    )
    return cut_replies(out[: len(prompts), width:].tolist(), eos_ids)


def cut_replies(rows: list[list[int]], eos_ids: list[int]) -> tuple[list[list[int]], int]:
    """Each row up to, not including, its first end-of-turn token; and how many rows have none (hit
    ``max_new_tokens``)."""
    replies, hit_limit = [], 0
    for row in rows:
        cut = next((j for j, t in enumerate(row) if t in eos_ids), None)
        if cut is None:
            hit_limit += 1
            cut = len(row)
        replies.append(row[:cut])
    return replies, hit_limit


def generate_continuous(
    model: Any,
    prompts: list[list[int]],
    cfg: RegenConfig,
    eos_ids: list[int],
    pad_id: int,
    seed: int | None,
) -> tuple[list[list[int]], int]:
    """One reply per prompt through transformers' continuous batching (``model.generate_batch``):
    a paged KV cache where a finished reply frees its slot for the next prompt at once, instead of
    a padded batch that runs until its longest reply ends. Up to ``cfg.batch_size`` replies are in
    flight together. Greedy replies equal ``model.generate``'s (tested); sampled ones follow
    ``seed`` but not the same random stream."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p) if cfg.do_sample else {}
    gen = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=cfg.do_sample,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **sampling,
    )
    sizing = {}
    if next(model.parameters()).device.type == "cpu":  # transformers would size the cache from all host memory
        page = 256
        per_reply = -(-(max(map(len, prompts)) + cfg.max_new_tokens) // page)
        sizing = dict(
            page_size=page, num_blocks=per_reply * min(cfg.batch_size, len(prompts)) + 1, max_batch_tokens=4096
        )
    cb = ContinuousBatchingConfig(max_requests_per_batch=cfg.batch_size, seed=seed, **sizing)
    results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    order = sorted(results, key=lambda rid: int(rid.rsplit("_", 1)[1]))  # request ids req_<i> follow the inputs
    rows = []
    for i, rid in enumerate(order):
        r = results[rid]
        if r.error or list(r.prompt_ids) != list(prompts[i]):
            raise RuntimeError(f"continuous batching: request {rid} failed or does not match prompt {i}: {r.error}")
        rows.append(list(r.generated_tokens))
    if len(rows) != len(prompts):
        raise RuntimeError(f"continuous batching returned {len(rows)} replies for {len(prompts)} prompts")
    return cut_replies(rows, eos_ids)
