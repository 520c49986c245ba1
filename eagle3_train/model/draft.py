"""The EAGLE-3 draft head (docs/concepts/draft-head.md): only the math.

    h   = fc(aux_hidden)                                  [B, T, n_aux*H_t] -> [B, T, H]
    x   = cat(input_layernorm(embed(next token)), hidden_norm(h))           [B, T, 2H]
    h'  = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
    out = h' + mlp(post_attention_layernorm(h'))                            (pre-norm output)
    logits = lm_head(norm(out))                                             [B, T, V_draft]

Training-time test (TTT) unrolls the head ``ttt_length`` times: step j >= 1 feeds step j-1's
pre-norm output back as h, with the next embedding one position further. The keys of step 0 are
visible causally; the keys of steps 1..j only on the diagonal (the same position), as at inference
where draft step j at position t attends to the accepted prefix and to its own earlier drafts.

Attention without a [T, T*(j+1)] mask: step j's query at t sees the causal step-0 keys (one fused
SDPA call, flash on GPU) plus j diagonal keys. The two parts are merged exactly through one extra
key prepended to the step-0 keys, whose score is a per-query constant c_t (an extra head dimension
carries it) and whose value is zero: SDPA then returns A = Z0*o0 / (e^c + Z0) and the extra key's
probability p = e^c / (e^c + Z0), with Z0 the step-0 softmax normaliser and o0 the step-0 output.
The full softmax over both parts is (A + p * sum_i e^(s_i - c) v_i) / (1 - p + p * sum_i e^(s_i - c))
for diagonal scores s_i -- exact for any c, and c = max_i s_i keeps every exponent <= 0. A leading
dummy query (its row dropped) makes the call SDPA's plain square causal pattern, which every fused
kernel takes without a mask. Memory per step is O(T); gradients flow through SDPA's own backward.

Inference runs the same :meth:`Eagle3Draft.step` with a cache that outlives the chain: ``cache[0]``
holds step 0's keys/values of every accepted position (computed once, from the target's states,
when the position is accepted), and the chain's steps 1..j append one entry each, dropped when the
next round's step 0 extends ``cache[0]`` -- as SGLang and vLLM keep an EAGLE-3 draft's KV cache. A
round's draft cost is then independent of the context length, and chain step j at the last
position t sees exactly what TTT step j at t sees in training.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    """Shapes of the draft head, derived from the target's config.

    Args:
        hidden_size: H of the draft (= the target's, so the target's embeddings fit).
        target_hidden_size: H_t of the captured states.
        num_aux: how many aux layers are concatenated (fc input = num_aux * H_t).
        num_attention_heads, num_key_value_heads, head_dim: attention shapes.
        intermediate_size: MLP width.
        rms_norm_eps: epsilon of every RMSNorm.
        vocab_size: the target vocab (embeddings, t2d).
        draft_vocab_size: the draft lm_head's vocab (d2t).
        max_position_embeddings, rope_parameters: RoPE as the target has it (scaling included).
        aux_norm: an RMSNorm over the concatenated aux states before ``fc`` (the engines'
            ``norm_before_fc``, weight ``input_norm`` in speculators' drafts). eagle3-export refuses
            a head trained with it.
        fc_norm: one RMSNorm per aux state (``fc_norm.<i>``) before ``fc``, after ``aux_norm``.
        norm_before_residual: the layer's residual is the normed hidden (``hidden_norm(h)``), not h.
        norm_output: chain steps after the first take the previous step's output through ``norm``
            (the one the logits see) rather than as it is.
        hidden_input_norm: the hidden half passes ``input_layernorm`` before ``hidden_norm`` (as
            NVIDIA ModelOpt's training computes its first layer; no engine does).
        The last four are what vLLM and SGLang compute for the engines' flags of the same names
        (speculators' drafts set them), or a peer's training: eagle3-eval reads them from
        third-party drafts, our training does not set them.
    """

    hidden_size: int
    target_hidden_size: int
    num_aux: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    aux_norm: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    hidden_input_norm: bool = False

    @classmethod
    def from_target(cls, target_config: Any, num_aux: int, draft_vocab_size: int) -> DraftConfig:
        c = getattr(target_config, "text_config", None) or target_config
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        rope = dict(rope)
        if "rope_theta" not in rope:
            rope["rope_theta"] = getattr(c, "rope_theta", 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        return cls(
            hidden_size=c.hidden_size,
            target_hidden_size=c.hidden_size,
            num_aux=num_aux,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            rms_norm_eps=c.rms_norm_eps,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=rope,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def llama_config(self) -> Any:
        """The equivalent one-layer LlamaConfig (for RoPE and for the exported config.json)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class TTTAttention(nn.Module):
    """Self-attention over ``cat(embedding, hidden)`` (2H) with the TTT key pattern: the weights
    (``project`` before the core, ``o_proj`` after it, both run by :class:`DraftLayer`) and the
    parameterless ``core`` (:class:`TTTCore`), which sequence parallelism wraps."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.core: nn.Module = TTTCore()  # sequence parallelism wraps it from outside

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, 2H] -> q [B, nh, T, d], k/v [B, nkv, T, d] (RoPE applied to q, k)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class TTTCore(nn.Module):
    """The attention without weights: this step's keys/values joined to the cache, then
    :func:`ttt_attention`. A module of its own so that parallelism can wrap it from outside (the
    sequence-parallel wrapper trades the sequence for the heads around it)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        step: int,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """q [B, nh, T, d], k/v [B, nkv, T, d] of step ``step``; ``cache[i]`` the (k, v) of step i < step
        (read only; for step 0 a non-empty ``cache[0]`` holds earlier positions, which this step's
        keys extend). Returns the attention [B, nh, T, d] and this step's entry ``cache[step]``."""
        if step == 0 and cache:  # [B, nkv, T_old, d] + [B, nkv, T, d] along positions
            k, v = torch.cat([cache[0][0], k], dim=2), torch.cat([cache[0][1], v], dim=2)
        keys = [(k, v)] if step == 0 else [*cache[:step], (k, v)]
        return ttt_attention(q, keys, q.shape[1] // k.shape[1], mask), (k, v)


def causal_lower_right(queries: int, keys: int) -> Any:
    """SDPA's lower-right causal pattern: query i sees keys up to ``keys - queries + i``. Imported
    when first needed: its module loads torch's compiler (3 s a process), which training without
    ``runtime.compile`` and most commands never use."""
    from torch.nn.attention.bias import causal_lower_right as bias

    return bias(queries, keys)


def ttt_attention(
    q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], groups: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, nh, T, d]; cache[0] = step 0's (k, v) [B, nkv, T_k, d] (T_k >= T: the last T
    positions are the queries'), cache[1:] = later steps' (k, v) [B, nkv, T, d]. Returns [B, nh, T, d].

    ``mask`` [B, T, T_k] (bool, True = visible) says which step-0 keys each query sees; None is
    lower-right causal (every key up to the query's own position). Batched inference passes one for
    caches whose rows hold padding or dropped entries; the diagonal keys are always visible.
    See the module docstring for the exact merge of the causal and diagonal parts.
    """
    k0, v0 = cache[0]
    b, nh, t, d = q.shape
    scale = d**-0.5
    if len(cache) == 1:
        if mask is not None:
            return F.scaled_dot_product_attention(
                q, k0, v0, attn_mask=mask[:, None], scale=scale, enable_gqa=groups > 1
            )
        if t < k0.shape[2]:  # queries after cached keys (inference); SDPA's is_causal is top-left aligned
            return F.scaled_dot_product_attention(
                q, k0, v0, attn_mask=causal_lower_right(t, k0.shape[2]), scale=scale, enable_gqa=groups > 1
            )
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale, enable_gqa=groups > 1)
    # diagonal scores of steps 1..j, fp32: j x [B, nh, T]. Query heads grouped over their kv head
    # ([B, nkv, g, T, d]) so the keys broadcast instead of being copied g times.
    nkv = k0.shape[1]
    qf = q.float().reshape(b, nkv, groups, t, d)  # one fp32 copy of q for every diagonal score
    s = [(qf * k.float()[:, :, None]).sum(-1).reshape(b, nh, t) * scale for k, _ in cache[1:]]
    c = torch.stack(s, -1).detach().amax(-1)  # [B, nh, T] per-query shift
    c_q = (c / scale).to(q.dtype)  # carried by the extra q dimension ...
    c = c_q.float() * scale  # ... so the shift used below is exactly the score SDPA sees
    w = [torch.exp(si - c) for si in s]  # each <= 1 (up to rounding)
    # The extra key (index 0, seen by every query) scores c_t; head dims padded to a multiple
    # of 8 for the fused kernels. Its value is zero but for one channel that reads back p.
    # [B, nkv, 1+T_k, d+pad] each, written in place (one copy of k0 and v0):
    pad, t_k = 8, k0.shape[2]
    k_aug, v_aug = k0.new_zeros(b, nkv, 1 + t_k, d + pad), v0.new_zeros(b, nkv, 1 + t_k, d + pad)
    k_aug[:, :, 0, d] = 1.0
    v_aug[:, :, 0, d] = 1.0
    k_aug[:, :, 1:, :d] = k0
    v_aug[:, :, 1:, :d] = v0
    # Query i sees the extra key and the step-0 keys up to its own position (lower-right causal).
    # With as many queries as keys (training) one leading dummy query makes that the square causal
    # pattern, which SDPA runs without any mask (flash on GPU, linear memory everywhere); its row
    # is dropped. With fewer queries (inference: new queries after the context) the lower-right
    # pattern or the caller's mask is given as such.
    square = int(mask is None and t == t_k)  # 1: the dummy query's row
    q_aug = q.new_zeros(b, nh, t + square, d + pad)  # [B, nh, (1+)T, d+pad]
    q_aug[:, :, square:, :d] = q
    q_aug[:, :, square:, d] = c_q
    if square:
        out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, is_causal=True, scale=scale, enable_gqa=groups > 1)[
            :, :, 1:
        ]
    else:
        attn_mask = causal_lower_right(t, t_k + 1) if mask is None else F.pad(mask, (1, 0), value=True)[:, None]
        out = F.scaled_dot_product_attention(
            q_aug, k_aug, v_aug, attn_mask=attn_mask, scale=scale, enable_gqa=groups > 1
        )
    a, p = out[..., :d].float(), out[..., d].float()  # Z0*o0/(e^c+Z0) [B,nh,T,d], e^c/(e^c+Z0) [B,nh,T]
    diag = sum(
        (wi.reshape(b, nkv, groups, t, 1) * v.float()[:, :, None]).reshape(b, nh, t, d)
        for wi, (_, v) in zip(w, cache[1:])
    )  # sum_i w_i v_i [B, nh, T, d]
    num = a + p.unsqueeze(-1) * diag
    den = (1 - p) + p * sum(w)
    return (num / den.unsqueeze(-1)).to(q.dtype)


class DraftLayer(nn.Module):
    """The one decoder layer: attention over cat(emb, hidden) (2H), residual on the hidden."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_input_norm = cfg.hidden_input_norm
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TTTAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        step: int,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """TTT step ``step``: [B, T, H] -> ([B, T, H], this step's (k, v), the entry ``cache[step]``
        becomes). ``cache`` is only read (see :class:`TTTCore`), so the call is a pure function of
        its arguments and can be recomputed in backward (activation checkpointing).
        """
        q, k, v = self.qkv(emb, hidden, cos, sin)
        attn, kv = self.self_attn.core(q, k, v, cache, step, mask)  # [B, nh, T, d]
        # one layout whatever produced it (SDPA's output is laid out [B, T, nh, d], the TTT merge's
        # [B, nh, T, d]): the compiled finish would otherwise compile again for the other
        return self.finish(attn.contiguous(), hidden), kv

    # The two parts around the attention core are the same function at every TTT step (the core's
    # keys grow with the step): ``runtime.compile`` compiles these, one graph each per grad mode.
    def qkv(
        self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """emb, hidden [B, T, H] -> q [B, nh, T, d], k/v [B, nkv, T, d] (normed, joined, projected, RoPE)."""
        h = self.input_layernorm(hidden) if self.hidden_input_norm else hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # [B, T, 2H]
        return self.self_attn.project(x, cos, sin)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn [B, nh, T, d] (the core's output), hidden [B, T, H] -> the layer's output [B, T, H]."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).flatten(2))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft head with Hugging Face module names (``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``), the target's frozen ``embed_tokens``, and the vocab map buffers ``d2t``/``t2d``.

    Args:
        cfg: shapes (see :class:`DraftConfig`).
    """

    d2t: torch.Tensor  # buffers, registered in __init__
    t2d: torch.Tensor

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's; SGLang swaps in its own
        if cfg.aux_norm:  # one norm over the whole n_aux*H_t width, as the concatenation reaches fc
            self.aux_norm = RMSNorm(cfg.num_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:  # one norm per aux state, as the engines' fc_norm
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())

    def unroll(
        self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, ttt_length: int, start: int = 0
    ) -> Iterator[torch.Tensor]:
        """Yield the pre-norm output [B, T, H] of TTT steps 0..ttt_length-1.

        Step j at position t sees the embedding of token t+1+j and (for j >= 1) step j-1's output
        at t; its RoPE position is t+j, as draft step j of a chain that starts after token t.
        Embeddings past the end of a row are those of token 0 (their positions never count).
        ``aux_hidden`` [B, T, n_aux*H_t] may hold only positions ``start .. start+T-1`` of the
        rows ``input_ids`` [B, T_all] (a sequence-parallel shard; the attention then has to see
        every shard's keys, which its wrapped ``core`` arranges).
        """
        b, t, _ = aux_hidden.shape
        hidden = self.fuse(aux_hidden)  # [B, T, n_aux*H_t] -> [B, T, H]
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        positions = torch.arange(start, start + t, device=aux_hidden.device).expand(b, t)
        for j in range(ttt_length):
            nxt = input_ids[:, start + 1 + j : start + 1 + j + t]
            nxt = F.pad(nxt, (0, t - nxt.shape[1]), value=0)  # [B, T]
            hidden = self.step(hidden, nxt, positions + j, cache, j)
            yield hidden

    def step(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        step: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft step, shared by training's unroll and inference's chain: the pre-norm output
        [B, T, H] from ``hidden`` [B, T, H] (``fuse(aux)`` for step 0, else step-1's output), the
        ids [B, T] of the token each position predicts after, at RoPE ``positions`` [B, T].
        ``cache[j]`` ends up holding step j's (k, v): the entries of steps >= ``step`` are dropped
        (a new chain) and this step's are appended. Step 0 with a non-empty cache extends
        ``cache[0]`` along the positions: inference runs step 0 over each round's newly accepted
        positions only, the earlier ones' keys and values being final (step 0 is causal). ``mask``
        as in :func:`ttt_attention`.
        """
        hidden = self.carry(hidden, step)
        emb = self.embed_tokens(next_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary_emb(hidden, positions)
        # the layer gets a copy of what it reads (step 0: the earlier positions' keys, if any), so
        # that the list it saw is unchanged if it runs again in backward (activation checkpointing)
        out, kv = self.midlayer(
            emb, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), cache[: max(step, 1)], step, mask
        )
        del cache[step:]
        cache.append(kv)
        return out

    def propose(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        k: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A greedy chain of ``k`` draft tokens, as target ids [B, k].

        ``hidden`` [B, H] is step 0's output at each row's last context position ``positions`` [B],
        ``cache[0]`` the step-0 keys/values of the context; ``mask`` [B, T_k] which of those each row
        sees (None: all). Chain step j feeds step j-1's output and its token back at position
        ``positions + j`` and attends to the context and to steps 1..j -- exactly what TTT step j
        at a context position sees in :meth:`unroll` (the cache keeps the chain's entries, which the
        next round's step 0 drops).
        """
        tokens = []
        chain_mask = None if mask is None else mask[:, None]  # [B, 1, T_k]
        for j in range(k):
            tokens.append(self.to_target(self.logits(hidden).argmax(-1)))  # [B]
            if j + 1 < k:
                hidden = self.step(
                    hidden[:, None], tokens[-1][:, None], (positions + j + 1)[:, None], cache, j + 1, chain_mask
                )[:, 0]
        return torch.stack(tokens, dim=1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids through ``d2t`` (offsets), any shape."""
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The draft's first hidden state from the captured ones: [..., n_aux*H_t] -> [..., H]
        (``fc``, after ``aux_norm`` and ``fc_norm`` when the head has them)."""
        x = self.aux_norm(aux_hidden) if self.config.aux_norm else aux_hidden
        if self.config.fc_norm:
            parts = x.split(self.config.target_hidden_size, dim=-1)
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(x)

    def carry(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        """What step ``step`` takes of ``hidden``: step 0 the fused states as they are; a later step
        the previous step's pre-norm output, through ``norm`` when the head has ``norm_output``."""
        return self.norm(hidden) if self.config.norm_output and step > 0 else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of a step's pre-norm output: [B, T, H] -> [B, T, V_draft]."""
        return self.lm_head(self.norm(hidden))
