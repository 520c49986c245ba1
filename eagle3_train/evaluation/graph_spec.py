"""``eagle3-eval decoder=graph``: greedy chain speculative decoding over static caches, one CUDA graph
per round, and plain greedy decoding through the same kernels, so that eval's speed-up compares two
decoders that are not bound by the launch of every kernel from Python.

The eager decoder (:mod:`eagle3_train.evaluation.decoding`) grows transformers' caches and decides
on the host after every verify step; on a small target both its speculative and its greedy loop
spend most of their time launching kernels, so the ratio of the two says little about a served
speed-up. Here, per batch of B rows (left-padded to W columns, row b's prompt starting at column
``start[b]``, its position p at column ``start[b] + p``):

- **prefill**: the model's own forward over the prompts (its keys/values copied into the static target
  cache, :class:`~eagle3_train.targets.static.StaticTarget`), then the draft's step 0 over the prompt
  columns into a static draft cache [2, B, kv, L, d];
- **a round** (the graph; ``length[b]`` tokens are final, ``last[b]`` is the target's next one, not yet
  in the caches, ``hidden[b]`` the draft's step-0 output at position ``length - 1``):

      d_1 = argmax draft_logits(hidden); d_j+1 from chain step j at position length-1+j   # [B, k]
      target over [last, d_1..d_k] at positions length..length+k                         # [B, k+1]
      a = accepted drafts (the longest prefix equal to the target's argmax, no end token)
      draft step 0 over the k+1 new columns: token i is followed by d_i+1 while i < a, then by
      the target's own token; hidden = its output at column a
      out[b, n_b .. n_b+a] = d_1..d_a, target token;  length += a + 1

  every round writes all k+1 columns (a row's rejected ones are junk beyond its length, which no
  query sees: each sees its row's columns up to its own, and the next round writes them again
  before any query reaches them). The draft's chain steps write their keys at the columns of their
  positions too, where the next round's step 0 writes over them: what chain step j sees is the
  context's step-0 keys and the chain's own, as in :meth:`Eagle3Draft.propose`.
- rows that end (an end token, or ``max_new`` tokens) stop writing their output and stop moving;
  the host looks at "have all rows ended?" before every round.
- a batch's buffers and its captured round are kept (at most ``graph_bytes`` of buffers, the least
  recently used dropped first) and used again by a later batch of the same shape (rows, columns L, k,
  max_new): its buffers are reset in place and the graph replayed, not captured again (prompt widths
  round up to ``WIDTH_STEP``, so shapes repeat; at batch 1 a capture per prompt would be timed).

Plain greedy decoding is the same round with k = 0 and no draft. On a CPU there is no graph: the same
round runs eagerly (the tests compare it with the eager decoder token for token in fp32).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_train.core.errors import ConfigError
from eagle3_train.evaluation.decoding import Counters, Decoded, SpecDecoder, in_batches, left_pad
from eagle3_train.model import Eagle3Draft
from eagle3_train.targets.static import Replayer, StaticTarget, unsupported

WIDTH_STEP = 64  # prompt widths are rounded up to this: the caches' shapes repeat across batches


def draft_step(
    draft: Eagle3Draft,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    cols: torch.Tensor,
    start: torch.Tensor,
    cache: torch.Tensor,
) -> torch.Tensor:
    """The draft's layer over a static cache: [B, T, H] -> [B, T, H] (pre-norm), its keys/values
    written at ``cols`` [B, T] of ``cache`` [2, B, kv, L, d]; each query sees its row's columns
    ``start..cols`` (:meth:`Eagle3Draft.step` with the cache a buffer instead of a list)."""
    emb = draft.embed_tokens(next_ids).to(hidden.dtype)  # [B, T, H]
    cos, sin = draft.rotary_emb(hidden, positions)
    q, k, v = draft.midlayer.qkv(emb, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype))  # [B, nh|nkv, T, d]
    at = cols[:, None, :, None].expand_as(k)
    cache[0].scatter_(2, at, k)
    cache[1].scatter_(2, at, v)
    columns = torch.arange(cache.shape[3], device=cols.device)
    visible = (columns >= start[:, None, None]) & (columns <= cols[:, :, None])  # [B, T, L]
    visible |= columns == cols[:, :, None]  # a padding query (left of start) sees itself: no row of -inf
    # The query heads that share a key head as one longer query row each ([B, kv, g*T, d]), the mask
    # repeated for them: SDPA's fused kernels take a mask but not grouped heads with it, and its
    # fallback would copy the whole cache for every query head.
    b, nh, t, d = q.shape
    g = nh // k.shape[1]
    mask = visible[:, None, None].expand(b, 1, g, t, visible.shape[-1]).reshape(b, 1, g * t, -1)
    attn = F.scaled_dot_product_attention(
        q.reshape(b, -1, g * t, d), cache[0], cache[1], attn_mask=mask, scale=d**-0.5
    ).view(b, nh, t, d)
    return draft.midlayer.finish(attn.contiguous(), hidden)


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class GraphSpecDecoder:
    """Greedy chain speculative decoding, and plain greedy decoding, over static caches (see the
    module docstring); the interface of :class:`~eagle3_train.evaluation.decoding.SpecDecoder`.

    Args:
        model: the target, a dense family of :data:`eagle3_train.targets.static.ARCHS`.
        draft: the draft head, on the target's device and dtype.
        layers: HF indices whose states feed the draft (the last = the last layer's pre-norm output).
        k: draft tokens per verify step.
        eos: ids that end generation.
        prefill: the eager decoder of the same model and draft, whose target forward runs the prompts
            (None: one is made).
        graph_bytes: the buffers of earlier batches kept for later batches of the same shape (their
            captured rounds with them); the current batch's are kept whatever their size.
    """

    def __init__(
        self,
        model: Any,
        draft: Eagle3Draft,
        layers: list[int],
        k: int,
        eos: set[int],
        prefill: SpecDecoder | None = None,
        graph_bytes: int = 2 << 30,
    ):
        why = unsupported(model, 0)
        if why is not None:
            raise ConfigError(f"eagle3-eval decoder=graph cannot run this target: {why}; use decoder=eager")
        rope = getattr(getattr(draft, "rotary_emb", None), "rope_type", "default")
        if "dynamic" in rope or rope == "longrope":  # its tables would be rebuilt on the host inside the graph
            raise ConfigError(
                f"eagle3-eval decoder=graph: the draft's rope_type {rope!r} rescales with the sequence; use decoder=eager"
            )
        self.model, self.draft, self.layers, self.k, self.eos = model, draft, layers, k, eos
        self.static = StaticTarget(model)
        self.device = self.static.device
        self.eos_ids = torch.tensor(sorted(eos), device=self.device)
        # the prompts' forward: the eager decoder's (it keeps the last layer's pre-norm state)
        self.prefill = prefill or SpecDecoder(model, draft, layers, k, eos)
        self.counters = Counters()
        self.graph_bytes = graph_bytes
        self.rounds: OrderedDict[tuple[int, ...], tuple[dict[str, torch.Tensor], Replayer]] = OrderedDict()
        self.states_made = 0  # buffers allocated (and rounds captured on a GPU): one per shape kept

    @torch.no_grad()
    def speculative(self, prompts: list[list[int]], max_new: int, batch_size: int) -> list[Decoded]:
        """Greedy speculative decoding of every prompt, ``batch_size`` at a time; results in the
        prompts' order (``accepted``: drafts accepted per verify step)."""
        return in_batches(prompts, batch_size, lambda batch: self._batch(batch, max_new, self.k))

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new: int, batch_size: int) -> list[Decoded]:
        """Plain greedy decoding through the same static target, one token per round (the timed baseline)."""
        return in_batches(prompts, batch_size, lambda batch: self._batch(batch, max_new, 0))

    def _batch(self, prompts: list[list[int]], max_new: int, k: int) -> list[Decoded]:
        if self.device.type == "cuda":  # graph capture uses the current device's stream: make it ours
            with torch.cuda.device(self.device):
                return self._decode(prompts, max_new, k)
        return self._decode(prompts, max_new, k)

    def _decode(self, prompts: list[list[int]], max_new: int, k: int) -> list[Decoded]:
        B, dev = len(prompts), self.device
        W = -(-max(map(len, prompts)) // WIDTH_STEP) * WIDTH_STEP
        # the last round may pass max_new by k and writes k+1 columns; a multiple of 64 keeps the
        # attention's key length aligned for the fused kernels
        L = -(-(W + max_new + 2 * k + 2) // WIDTH_STEP) * WIDTH_STEP
        why = unsupported(self.model, L)
        if why is not None:
            raise ConfigError(f"eagle3-eval decoder=graph cannot run this target: {why}; use decoder=eager")
        ids, valid = left_pad(prompts, dev)  # [B, w]
        ids = F.pad(ids, (W - ids.shape[1], 0))
        valid = F.pad(valid, (W - valid.shape[1], 0))  # [B, W]
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        lengths = valid.sum(1)  # [B]
        s, round_ = self._kept(B, L, W, k, max_new, lengths)
        # prefill: the model's own forward (its keys/values into the static cache), then draft step 0
        from transformers import DynamicCache

        hf_cache = DynamicCache()
        logits, aux = self.prefill.target_forward(
            ids, positions, valid, hf_cache, aux=k > 0, last_only=True
        )  # [B, 1, V], [B, W, n*H]
        self.static.fill(s["cache"], hf_cache, slice(None))
        del hf_cache
        s["last"].copy_(logits[:, -1].argmax(-1))
        if aux is not None:  # speculative (k > 0)
            nxt = torch.cat([ids[:, 1:], s["last"][:, None]], dim=1)  # [B, W]: the token after each position
            cols = torch.arange(W, device=dev).expand(B, W)
            out = draft_step(self.draft, self.draft.fuse(aux), nxt, positions, cols, s["start"], s["dcache"])
            s["hidden"].copy_(out[:, -1])
        s["out"][:, 0] = s["last"]
        s["n"].fill_(1)
        s["done"].copy_(self._is_eos(s["last"]) | (max_new <= 1))
        for _ in range(max_new):  # at most max_new rounds: each adds a token at least
            if bool(s["done"].all()):  # a look before every round: eval's batches are small
                break
            round_()
        n, r = s["n"].tolist(), s["rounds"].tolist()
        tokens, accepted = s["out"].tolist(), s["accepted"].tolist()
        result = []
        for b in range(B):
            d = Decoded(tokens[b][: n[b]], accepted[b][: r[b]] if k else [])
            cut = next((i + 1 for i, t in enumerate(d.tokens) if t in self.eos), len(d.tokens))
            d.tokens = d.tokens[: min(cut, max_new)]  # as plain greedy decoding
            result.append(d)
        if k:
            self.counters.row_rounds += sum(r)
        return result

    def _kept(
        self, B: int, L: int, W: int, k: int, max_new: int, lengths: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], Replayer]:
        """The buffers and round of a batch of this shape (an earlier batch's, zeroed in place: the
        graph reads these addresses; or new ones), its rows placed at their columns."""
        key = (B, L, k, max_new)
        if key in self.rounds:
            self.rounds.move_to_end(key)
            s, round_ = self.rounds[key]
            for name, t in s.items():
                if name not in ("cos", "sin"):  # the rope tables depend on the columns alone
                    t.zero_()
        else:
            s = self._state(B, L, k, max_new)
            round_ = Replayer(lambda: self._round(s, k, max_new), self.device)
            self.rounds[key] = (s, round_)
            self.states_made += 1
            while len(self.rounds) > 1 and sum(_nbytes(st) for st, _ in self.rounds.values()) > self.graph_bytes:
                self.rounds.popitem(last=False)  # the least recently used shape, its graph with it
        s["start"].copy_(W - lengths)  # [B] the first column of each row
        s["length"].copy_(lengths)  # [B] final tokens (positions 0..length-1 are in the caches)
        return s, round_

    def _state(self, B: int, L: int, k: int, max_new: int) -> dict[str, torch.Tensor]:
        """The buffers one batch's rounds read and write (fixed addresses: the graph's inputs), zeroed."""
        dev, draft = self.device, self.draft
        cfg = draft.config
        cos, sin = self.static.rope_tables(L)
        s = dict(
            cache=self.static.new_cache(B, L),
            cos=cos,
            sin=sin,
            start=torch.zeros(B, dtype=torch.long, device=dev),  # [B] the first column of each row
            length=torch.zeros(B, dtype=torch.long, device=dev),  # [B] final tokens
            last=torch.zeros(B, dtype=torch.long, device=dev),  # the target's next token, position length
            done=torch.zeros(B, dtype=torch.bool, device=dev),
            n=torch.zeros(B, dtype=torch.long, device=dev),  # tokens written to out
            rounds=torch.zeros(B, dtype=torch.long, device=dev),
            out=torch.zeros(B, max_new + k + 1, dtype=torch.long, device=dev),
            accepted=torch.zeros(B, max_new + 1, dtype=torch.long, device=dev),
        )
        if k:
            kv, d = cfg.num_key_value_heads, cfg.head_dim
            s["dcache"] = torch.zeros(2, B, kv, L, d, dtype=self.static.dtype, device=dev)
            s["hidden"] = torch.zeros(B, cfg.hidden_size, dtype=self.static.dtype, device=dev)
        return s

    def _is_eos(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids[..., None] == self.eos_ids).any(-1)  # a broadcast compare: nothing for the host to decide

    def _round(self, s: dict[str, torch.Tensor], k: int, max_new: int) -> None:
        """One verify step of every row (see the module docstring). Device-only (graph-safe)."""
        draft, length, start = self.draft, s["length"], s["start"]
        B = length.shape[0]
        slot = torch.arange(k + 1, device=length.device)[None]  # [1, k+1]
        drafts = torch.zeros(B, k, dtype=torch.long, device=length.device)
        if k:
            h, tokens = s["hidden"], []
            for j in range(k):  # the chain: step j at position length-1+j sees the context and steps 1..j
                tokens.append(draft.to_target(draft.logits(h).argmax(-1)))  # [B]
                if j + 1 < k:
                    p = (length - 1 + j + 1)[:, None]  # [B, 1]
                    h = draft_step(
                        draft,
                        draft.carry(h, j + 1)[:, None],
                        tokens[-1][:, None],
                        p,
                        start[:, None] + p,
                        start,
                        s["dcache"],
                    )[:, 0]
            drafts = torch.stack(tokens, dim=1)  # [B, k]
        pos = length[:, None] + slot  # [B, k+1]
        ids = torch.cat([s["last"][:, None], drafts], dim=1)
        x, kept = self.static.forward(
            ids, pos, start[:, None] + pos, start, s["cache"], (s["cos"], s["sin"]), tuple(self.layers) if k else ()
        )
        greedy = self.static.logits(x).argmax(-1)  # [B, k+1]: the target's token after each prefix
        match = (drafts == greedy[:, :k]) & ~self._is_eos(drafts)
        a = match.long().cumprod(1).sum(1)  # [B] accepted drafts
        new_last = greedy.gather(1, a[:, None])[:, 0]  # [B]
        new = torch.where(slot < a[:, None], F.pad(drafts, (0, 1)), new_last[:, None])  # [B, k+1]
        live = ~s["done"]
        if k:  # step 0 over the k+1 new columns, each followed by the next accepted token
            aux = torch.cat([x if i == len(self.static.layers) else kept[i] for i in self.layers], dim=-1)
            out0 = draft_step(draft, draft.fuse(aux), new, pos, start[:, None] + pos, start, s["dcache"])
            h0 = out0.gather(1, a[:, None, None].expand(B, 1, out0.shape[-1]))[:, 0]  # [B, H] at column a
            s["hidden"].copy_(torch.where(live[:, None], h0, s["hidden"]))
        at = (s["n"][:, None] + slot).clamp(max=s["out"].shape[1] - 1)  # [B, k+1]
        s["out"].scatter_(1, at, torch.where(live[:, None], new, s["out"].gather(1, at)))
        r = s["rounds"][:, None]
        s["accepted"].scatter_(1, r, torch.where(live, a, s["accepted"].gather(1, r)[:, 0])[:, None])
        step = (a + 1) * live
        s["n"] += step
        s["rounds"] += live.long()
        length += step
        s["last"].copy_(torch.where(live, new_last, s["last"]))
        s["done"] |= live & (self._is_eos(new_last) | (s["n"] >= max_new))
