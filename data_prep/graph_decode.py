"""``regen.batching=graph``: our own decode loop for dense Llama-family targets, one CUDA graph per batch.

Why: transformers' ``generate`` spends most of a decode step outside the GPU (per-step Python,
a cache that grows by concatenation, masks rebuilt every step): on one H200 the 135M embedded
target writes 13-26k new tokens/s with the GPU 20-60 % busy, while its arithmetic allows ten
times that. Here a decode step of the whole batch is a fixed sequence of kernels on buffers that
never move, so it is captured once per batch as a CUDA graph and replayed ``max_new_tokens - 1``
times; the tokens, the positions and the step counter live on the device, and the host looks at
the batch only every ``CHECK_EVERY`` steps (all rows ended?).

One batch (B prompts, widest W tokens, T = ``max_new_tokens``):

1. **Prefill**: the model's own forward over the left-padded prompts (position ids
   ``cumsum(mask) - 1`` as ``generate`` makes them), in row slices whose key/value cache stays
   under ``PREFILL_KV_BYTES``, only the last position's logits; its key/value cache is copied into a static cache
   ``[B, kv_heads, W + T, head_dim]`` per layer. The first new token comes from these logits.
2. **Decode step** t = 1 .. T-1 (the graph), per layer (:class:`eagle3_train.targets.static.StaticTarget`,
   shared with ``eagle3-eval decoder=graph``), with ``x`` the new token's state ``[B, H]``::

       q, k, v = q_proj(norm(x)), k_proj(..), v_proj(..)     # [B, heads|kv, d] (+ q_norm/k_norm: Qwen3)
       q, k = rope(q, k, position)                         # position = prompt length + t - 1
       K[:, :, W + t - 1], V[..] = k, v                    # the cache column of this step
       a = softmax(q K^T * scale, masked to the row's prompt and the steps so far)   # fp32
       x = x + o_proj(a V);  x = x + mlp(post_norm(x))

   then ``lm_head(norm(x))`` picks the next token: its argmax (greedy), or, sampled, the
   temperature-scaled distribution cut to its top-p mass and drawn by the exponential race
   ``argmax(p / E)``, ``E ~ Exp(1)`` (a draw from ``p``, with no host sync, so it can be captured).
   The top-p cut needs no sort when top_p is near 1 (:func:`top_p_by_rejection`); otherwise the
   probabilities are sorted (:func:`top_p_by_sorting`).

The norms, projections, MLP and rotary tables are the model's own modules, so the arithmetic is
the model's; only the attention over the static cache is ours (GQA by grouping the query heads,
no repeated keys). Greedy replies equal ``model.generate``'s padded batches token for token in
fp32 (tested); in bf16 a few may part after a near tie, as any two batchings do. Sampled replies
follow ``torch.manual_seed`` but not ``generate``'s random stream. Only temperature and top-p apply:
extras of the model's ``generation_config`` that ``generate`` would add (a repetition penalty, a top-k)
do not, as in the served engines. On a CPU there is no graph: the same step runs eagerly (the tests
use it).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from eagle3_train.core.errors import ConfigError
from eagle3_train.targets.static import Replayer, StaticTarget, unsupported

PREFILL_KV_BYTES = 8 << 30  # the transformers cache one prefill slice builds before it is copied (sets its rows)
CHECK_EVERY = 16  # decode steps between the host's looks at "have all rows ended?"
CACHE_SHARE = (
    0.6  # of the GPU's memory less the model's weights, per process on the GPU: the most one batch's buffers may take
)
WIDTH_STEP = 64  # prompt widths are rounded up to this: the cache's shape repeats across batches
TOP_P_MISS = 1e-6  # the most probability a row may have of no round of top_p_by_rejection accepting
TOP_P_MAX_ROUNDS = 4  # top_p_by_rejection when it needs at most this many rounds, else top_p_by_sorting


def check_supported(model: Any, length: int) -> None:
    """A ConfigError naming why this decoder cannot run ``model`` (``length``: the longest prompt plus
    ``max_new_tokens``), if it cannot."""
    why = unsupported(model, length)
    if why is not None:
        raise ConfigError(
            f"regen.batching=graph cannot run this target: {why}; use regen.batching=padded or a served "
            f"engine (regen.backend=vllm)"
        )


class GraphDecoder:
    """Greedy or sampled replies of one model to batches of prompts (see the module docstring).

    Args:
        model: a ``*ForCausalLM`` of a family in ``eagle3_train.targets.static.ARCHS``, in eval mode.
        max_new_tokens: the longest reply.
        eos_ids: the tokens that end a reply.
        pad_id: the token written left of shorter prompts (never attended to).
        do_sample, temperature, top_p: sampling; greedy when ``do_sample`` is false.
    """

    def __init__(
        self,
        model: Any,
        max_new_tokens: int,
        eos_ids: list[int],
        pad_id: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        memory_share: float = CACHE_SHARE,
    ) -> None:
        check_supported(model, 0)
        self.model, self.T, self.pad = model, max_new_tokens, pad_id
        self.sample = (temperature, top_p) if do_sample else None
        self.rounds = top_p_rounds(top_p) if do_sample else 0
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos = torch.tensor(sorted(set(eos_ids)), device=self.device)
        self.static = StaticTarget(model)
        if self.device.type == "cuda":  # what one process may give a batch's buffers (rows_per_batch)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            total = torch.cuda.get_device_properties(self.device).total_memory
            self.budget = int((total - weights) * memory_share / processes_per_gpu())

    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position, all layers."""
        t = self.static
        return 2 * len(t.layers) * t.kv_heads * t.head_dim * self.dtype.itemsize

    def rows_per_batch(self, width: int, wanted: int) -> int:
        """At most ``wanted`` rows, fewer where one batch's buffers (the static cache of ``width`` + T
        columns, the step's fp32 logits and, sampling, the sort's copies of them) would pass
        ``memory_share`` of the GPU's memory less the weights, shared by the processes on the GPU.
        Sized from the GPU's total, not its momentary free memory, so a run splits its batches
        the same way every time (sampled replies depend on the split)."""
        if self.device.type != "cuda":
            return wanted
        vocab = self.model.lm_head.out_features
        per_row = self.kv_bytes_per_token() * (width + self.T) + vocab * (32 if self.sample else 8)
        return max(1, min(wanted, self.budget // per_row))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """``T`` new tokens per prompt (rows that ended continue with whatever follows; the caller cuts
        at the first end-of-turn token). Prompts are left-padded to the widest, rounded up to
        ``WIDTH_STEP``."""
        if self.device.type == "cuda":  # graph capture uses the current device's stream: make it ours
            with torch.cuda.device(self.device):
                return self._generate(prompts)
        return self._generate(prompts)

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        B = len(prompts)
        W = -(-max(map(len, prompts)) // WIDTH_STEP) * WIDTH_STEP
        check_supported(self.model, W + self.T)
        ids = torch.full((B, W), self.pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, W - len(p) :] = torch.tensor(p)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # [B]
        ids = ids.to(self.device)
        s = self._state(B, W)
        first = self._prefill(ids, lengths, s)  # [B]
        s["out"][:, 0] = first
        s["tok"].copy_(first)
        s["done"].copy_(self._ends(first))
        s["pos"].copy_(lengths)
        s["start"].copy_(W - lengths)
        steps, t = self.T - 1, 0
        step = Replayer(lambda: self._step(s), self.device)
        while t < steps:
            if t % CHECK_EVERY == 0 and bool(s["done"].all()):
                break
            step()
            t += 1
        out = s["out"][:, : t + 1]
        if t + 1 < self.T:  # every row ended early: pad as generate would
            out = torch.cat([out, out.new_full((B, self.T - t - 1), int(self.eos[0]))], 1)
        return out.tolist()

    def _state(self, B: int, W: int) -> dict[str, torch.Tensor]:
        """The buffers one batch's steps read and write (fixed addresses: the graph's inputs)."""
        dev, L = self.device, W + self.T
        cos, sin = self.static.rope_tables(L)  # [L, d] each
        return dict(
            cache=self.static.new_cache(B, L),
            cos=cos,
            sin=sin,
            W=torch.tensor(W, device=dev),
            col=torch.full((), W, dtype=torch.long, device=dev),  # the cache column of the next step
            tok=torch.zeros(B, dtype=torch.long, device=dev),
            pos=torch.zeros(B, dtype=torch.long, device=dev),
            start=torch.zeros(B, dtype=torch.long, device=dev),
            done=torch.zeros(B, dtype=torch.bool, device=dev),
            out=torch.zeros(B, self.T, dtype=torch.long, device=dev),
        )

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, s: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run the prompts through the model in row slices; fill the static cache; return the first
        new token of each row. ``ids``: [B, W] left-padded."""
        B, W = ids.shape
        rows = max(1, PREFILL_KV_BYTES // (self.kv_bytes_per_token() * W))
        first = []
        for r in range(0, B, rows):
            x = ids[r : r + rows]
            mask = (torch.arange(W, device=ids.device)[None] >= (W - lengths[r : r + rows])[:, None]).long()
            position = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=x, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
            # not out.get("cache", out.past_key_values): that reads the attribute even when "cache" is there
            cache = out["cache"] if "cache" in out else out.past_key_values  # noqa: SIM401
            self.static.fill(s["cache"], cache, slice(r, r + rows))
            first.append(self._pick(out.logits[:, -1].float()))
            del out, cache  # the slice's transformers cache goes before the next slice builds its own
        return torch.cat(first)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row from its logits [B, V] (fp32)."""
        if self.sample is None:
            return logits.argmax(-1)
        temperature, top_p = self.sample
        p = torch.softmax(logits / temperature, -1)  # [B, V]
        if top_p >= 1:
            return race(p)
        if self.rounds:
            return top_p_by_rejection(p, top_p, self.rounds)
        return race(top_p_by_sorting(p, top_p))

    def _ends(self, tok: torch.Tensor) -> torch.Tensor:
        """Which tokens [B] end a reply."""
        return (tok[:, None] == self.eos).any(-1)

    def _step(self, s: dict[str, torch.Tensor]) -> None:
        """One decode step of the batch: read ``tok`` at ``pos``, write its keys/values at cache column
        ``col``, append the next token to ``out``; advance ``pos``, ``col``. Device-only (graph-safe)."""
        tok, pos = s["tok"], s["pos"]
        cols = s["col"].expand(tok.shape[0])[:, None]  # [B, 1]: every row writes the step's column
        x, _ = self.static.forward(tok[:, None], pos[:, None], cols, s["start"], s["cache"], (s["cos"], s["sin"]))
        logits = self.static.logits(x[:, 0]).float()  # [B, V]
        nxt = self._pick(logits)
        step = s["col"] - s["W"] + 1  # this token's index in the reply
        s["out"].index_copy_(1, step[None], nxt[:, None])
        s["done"] |= self._ends(nxt)
        tok.copy_(nxt)
        pos += 1
        s["col"] += 1


def race(p: torch.Tensor) -> torch.Tensor:
    """A draw from each row of ``p`` [B, V] (unnormalised weights), with no host sync: the
    exponential race ``argmax(p / E)``, ``E ~ Exp(1)``."""
    return (p / torch.empty_like(p).exponential_()).argmax(-1)


def top_p_by_sorting(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """``p`` [B, V] with each row cut to its nucleus: a token stays while the more probable ones
    hold at most ``top_p`` of the mass (the first always stays)."""
    sp, order = p.sort(-1, descending=True)
    sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0)
    return torch.zeros_like(p).scatter_(-1, order, sp)


def top_p_rounds(top_p: float) -> int:
    """Rounds :func:`top_p_by_rejection` needs for ``top_p`` (a round rejects with probability at
    most 1 - top_p), or 0 where sorting is cheaper (more than ``TOP_P_MAX_ROUNDS``) or nothing is
    cut (top_p >= 1)."""
    if top_p >= 1:
        return 0
    rounds = math.ceil(math.log(TOP_P_MISS) / math.log(1 - top_p) - 1e-9) if top_p > 0 else TOP_P_MAX_ROUNDS + 1
    return rounds if rounds <= TOP_P_MAX_ROUNDS else 0


def top_p_by_rejection(p: torch.Tensor, top_p: float, rounds: int) -> torch.Tensor:
    """A draw from each row of ``p`` [B, V] (probabilities) restricted to its nucleus, without
    sorting ``[B, V]``: draw from the tokens still allowed; accept the draw x when the tokens more
    probable than x hold at most ``top_p`` (x is in the nucleus); else every token at most as
    probable as x is outside it too, so allow only the more probable ones and draw again.

    An accepted draw is p renormalised over the nucleus, since the allowed tokens always include
    the whole nucleus. A round rejects with probability at most 1 - top_p (the allowed tokens
    outside the nucleus hold at most that much, the nucleus at least top_p); a row that no round
    accepts takes its argmax, which is in every nucleus. Tied probabilities are in or out
    together (sorting would split them at the boundary). A round is a few passes over ``p``
    against a sort's many."""
    pick = p.argmax(-1)  # [B]
    done = torch.zeros_like(pick, dtype=torch.bool)
    allowed = p
    for _ in range(rounds):
        x = race(allowed)  # [B]
        allowed = torch.where(p > p.gather(-1, x[:, None]), p, 0)  # [B, V]: more probable than x
        inside = allowed.sum(-1) <= top_p  # [B]
        pick = torch.where(inside & ~done, x, pick)
        done |= inside
    return pick


def processes_per_gpu() -> int:
    """Processes of this node that share one GPU (torchrun's local world over the GPUs it sees)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, -(-local // max(1, torch.cuda.device_count())))


def generate_graph(
    model: Any, prompts: list[list[int]], cfg: Any, eos_ids: list[int], pad_id: int, bar: Any = None
) -> list[list[int]]:
    """Every prompt's ``cfg.max_new_tokens`` new tokens through ``GraphDecoder``, in length-sorted
    batches of up to ``cfg.batch_size`` rows (fewer where the static cache would not fit); in the
    order of ``prompts``."""
    dec = GraphDecoder(
        model,
        cfg.max_new_tokens,
        eos_ids,
        pad_id,
        do_sample=cfg.do_sample,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        memory_share=cfg.memory_share,
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows: list[list[int]] = [[] for _ in prompts]
    b = 0
    while b < len(order):
        n = cfg.batch_size
        while True:  # the longest prompt of the slice sets its width, and the width how many rows fit
            width = -(-len(prompts[order[min(b + n, len(order)) - 1]]) // WIDTH_STEP) * WIDTH_STEP
            fit = dec.rows_per_batch(width, n)
            if fit >= n:
                break
            n = fit
        batch = order[b : b + n]
        for i, r in zip(batch, dec.generate([prompts[i] for i in batch])):
            rows[i] = r
        if bar is not None:
            bar.update(len(batch))
        b += n
    return rows
