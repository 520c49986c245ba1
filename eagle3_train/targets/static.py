"""A dense target's forward over a static key/value cache: the decoder step our graph-captured loops
replay (``regen.batching=graph``'s reply writer, ``eagle3-eval decoder=graph``'s speculative decoder).

Why not the model's own forward: transformers grows its cache by concatenation and rebuilds masks
every step, so a step's shapes and buffers change and it cannot be captured as one CUDA graph. Here
the cache is ``[layers, 2, B, kv_heads, L, head_dim]`` at a fixed address, and each row writes its new
tokens at its own columns (``cols`` [B, T]), given on the device like every other input, so the same
kernels serve every step and the host never has to look at a value.

For T new tokens per row at ``positions`` [B, T] and cache columns ``cols`` [B, T], per layer::

    q, k, v = q_proj(norm(x)), k_proj(..), v_proj(..)    # [B, T, heads|kv, d] (+ q_norm/k_norm: Qwen3)
    q, k = rope(q, k, positions)
    K[b, :, cols[b, t]], V[..] = k, v                    # each token's own column
    a = softmax(q K^T * scale) over the columns start[b] <= l <= cols[b, t]   # fp32
    x = x + o_proj(a V);  x = x + mlp(post_norm(x))

A query sees its row's columns from ``start`` up to its own, so whatever a column beyond it holds
(an earlier round's rejected drafts, another row's padding) gets weight exactly 0. The norms,
projections, MLP and rotary tables are the model's own modules; only the attention is ours (GQA by
grouping the query heads over their key head, no repeated keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_train.core import families
from eagle3_train.model.draft import rotate_half


@dataclass(frozen=True)
class Arch:
    """What one model family's decoder layer needs beyond Llama's."""

    qk_norm: bool  # an RMSNorm over each head's query and key before the rotary embedding (Qwen3)


# model_type -> its quirks: the family table's static_qk_norm column (eagle3_train/core/families.py).
# Dense decoders with full attention only: a MoE block routes tokens with data-dependent shapes (no
# graph), a sliding window would need its own mask.
ARCHS = {f.model_type: Arch(qk_norm=f.static_qk_norm) for f in families.FAMILIES if f.static_qk_norm is not None}


def unsupported(model: Any, length: int) -> str | None:
    """Why the static step cannot run ``model`` on sequences of ``length`` tokens, or None."""
    cfg = model.config
    if cfg.model_type not in ARCHS:
        return f"it runs dense {sorted(ARCHS)} targets, not model_type {cfg.model_type!r}"
    rope = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type", "default")
    if "dynamic" in rope or rope == "longrope":  # their tables change with the sequence: one table cannot serve
        return f"rope_type {rope!r} rescales with the sequence length"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and length > window:
        return f"{cfg.model_type} attends within a sliding window of {window} tokens, and sequences reach {length}"
    return None


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers cache, each [B, kv_heads, W, head_dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(c.keys, c.values) for c in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


class StaticTarget:
    """The decoder of a model in :data:`ARCHS` over a static cache (see the module docstring).

    Args:
        model: a ``*ForCausalLM`` of a family in ``ARCHS``, in eval mode (its modules are used as they are).
    """

    def __init__(self, model: Any):
        self.model, self.inner = model, model.model
        self.arch = ARCHS[model.config.model_type]
        self.layers = list(self.inner.layers)
        cfg = model.config
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def new_cache(self, rows: int, columns: int) -> torch.Tensor:
        """An empty cache [layers, 2, rows, kv_heads, columns, head_dim]."""
        shape = (len(self.layers), 2, rows, self.kv_heads, columns, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def fill(self, cache: torch.Tensor, hf_cache: Any, rows: slice) -> None:
        """Copy a transformers cache of ``W`` columns into columns ``[:W]`` of ``rows``."""
        for li, (k, v) in enumerate(cache_layers(hf_cache)):
            cache[li, 0, rows, :, : k.shape[2]] = k
            cache[li, 1, rows, :, : v.shape[2]] = v

    def rope_tables(self, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [columns, d] for every position a row can reach."""
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, torch.arange(columns, device=self.device)[None])
        return cos[0], sin[0]

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cols: torch.Tensor,
        start: torch.Tensor,
        cache: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keep: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """T new tokens per row through every layer, their keys/values written to the cache.

        Args:
            ids: [B, T] the tokens.
            positions: [B, T] their RoPE positions.
            cols: [B, T] their cache columns (each query sees its row's columns ``start..cols``).
            start: [B] each row's first column (left of it: padding).
            cache: from :meth:`new_cache`, written in place.
            rope: from :meth:`rope_tables`.
            keep: HF hidden-state indices to return (0: the embeddings, i: layer i's output; the
                last layer's is before the final norm, as engines capture it).

        Returns:
            The last layer's output [B, T, H] (before the final norm) and ``{index: [B, T, H]}``.
        """
        B, T = ids.shape
        kvh, d = self.kv_heads, self.head_dim
        cos, sin = rope[0][positions][:, :, None], rope[1][positions][:, :, None]  # [B, T, 1, d]
        columns = torch.arange(cache.shape[4], device=ids.device)
        visible = (columns >= start[:, None, None]) & (columns <= cols[:, :, None])  # [B, T, L]
        visible = visible[:, None, None]  # [B, 1, 1, T, L]
        at = cols[:, None, :, None].expand(B, kvh, T, d)  # scatter index into [B, kv, L, d]
        x = self.inner.embed_tokens(ids)  # [B, T, H]
        kept = {0: x} if 0 in keep else {}
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, -1, d)  # [B, T, heads, d]
            k = attn.k_proj(h).view(B, T, kvh, d)
            v = attn.v_proj(h).view(B, T, kvh, d)
            if self.arch.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            cache[li, 0].scatter_(2, at, k.transpose(1, 2))  # [B, kv, L, d] at each token's column
            cache[li, 1].scatter_(2, at, v.transpose(1, 2))
            q = q.view(B, T, kvh, -1, d).permute(0, 2, 3, 1, 4)  # [B, kv, group, T, d]: heads sharing a key head
            scores = torch.einsum("bkgtd,bkld->bkgtl", q, cache[li, 0]).float() * attn.scaling
            a = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).to(v.dtype)
            o = torch.einsum("bkgtl,bkld->bkgtd", a, cache[li, 1])  # [B, kv, group, T, d]
            x = x + attn.o_proj(o.permute(0, 3, 1, 2, 4).reshape(B, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if li + 1 in keep:
                kept[li + 1] = x
        return x, kept

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits of a last-layer output (final norm, lm_head): [..., H] -> [..., V]."""
        return self.model.lm_head(self.inner.norm(x))


class Replayer:
    """Runs a device-only ``step`` (one that reads and writes only buffers of fixed address) again and
    again: on a CPU eagerly; on a GPU the first ``warmup`` calls eagerly on a side stream (as graph
    capture wants; they warm the kernels up), then the step is captured once as a CUDA graph (capture
    records it without running it) and replayed on every call from then on.

    Args:
        step: the step, a function of nothing.
        device: where its buffers live.
        warmup: eager calls before the capture.
    """

    def __init__(self, step: Callable[[], None], device: torch.device, warmup: int = 2):
        self.step, self.device, self.warmup = step, device, warmup
        self.calls = 0
        self.graph: Any = None

    def __call__(self) -> None:
        if self.device.type != "cuda":
            self.step()
        elif self.graph is None and self.calls >= self.warmup:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
            self.graph.replay()
        elif self.graph is not None:
            self.graph.replay()
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(self.device).wait_stream(side)
        self.calls += 1
