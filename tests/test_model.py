"""The draft head: sub-layers against transformers' Llama modules, TTT attention against a dense
reference mask, and the unroll's shifts."""

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from eagle3_train.model.draft import MLP, DraftConfig, Eagle3Draft, RMSNorm, apply_rope, ttt_attention
from eagle3_train.targets.tiny import tiny_config

torch.manual_seed(0)


def draft_cfg(**kw):
    return DraftConfig.from_target(tiny_config(), num_aux=3, draft_vocab_size=kw.pop("draft_vocab_size", 48))


def test_config_from_target():
    c = draft_cfg()
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 16)
    assert c.intermediate_size == 128 and c.vocab_size == 320 and c.num_aux == 3
    llama31 = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    c8 = DraftConfig.from_target(llama31, 3, 32000)
    assert c8.rope_parameters["rope_type"] == "llama3" and c8.head_dim == 128


def test_rmsnorm_and_mlp_match_transformers():
    norm, ref = RMSNorm(64, 1e-5), hf.LlamaRMSNorm(64, eps=1e-5)
    nn.init.normal_(norm.weight)
    ref.weight.data.copy_(norm.weight.data)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(norm(x), ref(x))
    mlp, ref_mlp = MLP(64, 128), hf.LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=128))
    ref_mlp.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(mlp(x), ref_mlp(x))


def test_step0_attention_matches_llama_attention():
    """Step 0 is plain causal GQA attention with RoPE over a 2H-wide input."""
    cfg = draft_cfg()
    model = Eagle3Draft(cfg)
    attn = model.midlayer.self_attn
    lc = LlamaConfig(
        hidden_size=2 * cfg.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=dict(cfg.rope_parameters),
        attn_implementation="eager",
    )
    ref = hf.LlamaAttention(lc, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(ref, name).weight.data.copy_(getattr(attn, name).weight.data)
    ref.o_proj = nn.Identity()
    x = torch.randn(2, 7, 2 * cfg.hidden_size)
    pos = torch.arange(7).expand(2, 7)
    cos, sin = model.rotary_emb(x, pos)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    want, _ = ref(x, (cos, sin), attention_mask=mask)
    q, k, v = attn.project(x, cos, sin)
    got = ttt_attention(q, [(k, v)], groups=2).transpose(1, 2).reshape(2, 7, -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # RoPE itself
    qq = torch.randn(2, 4, 7, 16)
    torch.testing.assert_close(apply_rope(qq, cos, sin), hf.apply_rotary_pos_emb(qq, qq, cos, sin)[0])


def dense_ttt_reference(q, cache, groups):
    """Keys of all steps side by side, with the TTT mask written out: [T, T*(j+1)]."""
    t, d = q.shape[2], q.shape[3]
    j = len(cache) - 1
    keys = torch.cat([k.repeat_interleave(groups, 1) for k, _ in cache], 2)
    values = torch.cat([v.repeat_interleave(groups, 1) for _, v in cache], 2)
    mask = torch.zeros(t, t * (j + 1), dtype=torch.bool)
    mask[:, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(1, j + 1):
        mask[:, i * t : (i + 1) * t] = torch.eye(t, dtype=torch.bool)
    scores = (q @ keys.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ values


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_ttt_attention_equals_dense_mask(steps):
    b, nh, nkv, t, d = 2, 4, 2, 11, 16
    q = (torch.randn(b, nh, t, d) * 3).requires_grad_()
    cache = [
        (torch.randn(b, nkv, t, d, requires_grad=True), torch.randn(b, nkv, t, d, requires_grad=True))
        for _ in range(steps)
    ]
    got, want = ttt_attention(q, cache, nh // nkv), dense_ttt_reference(q, cache, nh // nkv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(got)
    leaves = [q] + [x for kv in cache for x in kv]
    for a, b_ in zip(torch.autograd.grad((got * g).sum(), leaves), torch.autograd.grad((want * g).sum(), leaves)):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5)


def test_ttt_attention_stays_finite_with_large_scores():
    b, nh, t, d = 1, 2, 64, 16
    q = torch.randn(b, nh, t, d) * 30
    cache = [(torch.randn(b, nh, t, d) * 30, torch.randn(b, nh, t, d)) for _ in range(3)]
    got, want = ttt_attention(q, cache, 1), dense_ttt_reference(q, cache, 1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_unroll_steps_see_shifted_embeddings_and_feed_back():
    """Step j at position t uses the embedding of token t+1+j and step j-1's output at t."""
    cfg = draft_cfg()
    model = Eagle3Draft(cfg).eval()
    aux = torch.randn(1, 6, 3 * 64)
    ids = torch.randint(0, 256, (1, 6))
    outs = list(model.unroll(aux, ids, 3))
    assert [o.shape for o in outs] == [torch.Size([1, 6, 64])] * 3
    # changing token 4 cannot change step 0 before position 3, nor step 1 before position 2
    ids2 = ids.clone()
    ids2[0, 4] = (ids[0, 4] + 1) % 256
    outs2 = list(model.unroll(aux, ids2, 3))
    torch.testing.assert_close(outs2[0][:, :3], outs[0][:, :3])
    torch.testing.assert_close(outs2[1][:, :2], outs[1][:, :2])
    assert not torch.allclose(outs2[0][:, 3], outs[0][:, 3])
    assert not torch.allclose(outs2[1][:, 2], outs[1][:, 2])
    assert model.logits(outs[0]).shape == (1, 6, 48)


def test_weight_names_are_what_engines_load():
    names = set(Eagle3Draft(draft_cfg()).state_dict())
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} | {
        f"midlayer.{n}.weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "hidden_norm",
            "input_layernorm",
            "post_attention_layernorm",
        )
    }
    assert names == expected


def test_aux_norm_is_one_rmsnorm_before_fc():
    """model.aux_norm: the first hidden state is fc(RMSNorm(cat(aux))), one norm over the whole
    n_aux*H_t width (transformers' LlamaRMSNorm as reference), and the unroll is a plain head's on
    normalised states; without the option the head has no such weight."""
    from dataclasses import replace

    cfg = draft_cfg()
    head = Eagle3Draft(replace(cfg, aux_norm=True))
    nn.init.normal_(head.aux_norm.weight)
    ref = hf.LlamaRMSNorm(3 * 64, eps=cfg.rms_norm_eps)
    ref.weight.data.copy_(head.aux_norm.weight.data)
    aux, ids = 5 * torch.randn(2, 6, 192), torch.randint(0, 320, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(aux), head.fc(ref(aux)))
        plain = Eagle3Draft(cfg)
        plain.load_state_dict({k: v for k, v in head.state_dict().items() if k != "aux_norm.weight"})
        for a, b in zip(head.unroll(aux, ids, 3), plain.unroll(ref(aux), ids, 3), strict=True):
            torch.testing.assert_close(a, b)
    assert "aux_norm.weight" not in plain.state_dict()
