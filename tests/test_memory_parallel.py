"""Issue #17's memory and parallelism options against the reference they must not change: a TTT
loss written out with the dense [T, T*(j+1)] attention mask and whole logits (fp32). The fused
lm_head + loss, activation checkpointing and sequence parallelism (2 ranks, gloo) each give its
loss and gradients; the saved activations grow linearly with the sequence length."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagle3_train.core.errors import ConfigError
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.model.draft import apply_rope
from eagle3_train.targets.tiny import tiny_config
from eagle3_train.training.config import DeepSpeedConfig, RuntimeConfig, TrainConfig
from eagle3_train.training.data import Batch
from eagle3_train.training.objective import ALPHA_FLOOR, Objective, head_loss, lk_loss, soft_cross_entropy
from eagle3_train.training.parallel import (
    SequenceParallel,
    apply_activation_checkpointing,
    apply_compile,
    apply_sequence_parallel,
)
from eagle3_train.training.ttt import ttt_losses

TTT, DECAY = 4, 0.8


def tiny_problem(seed=0, t=13, b=2):
    """A head (draft vocab: two thirds of the target's), its target lm_head and t2d, and a batch
    with rows of different lengths and a random loss mask."""
    g = torch.Generator().manual_seed(seed)
    v, h = 320, 64
    t2d = torch.arange(v) % 3 != 0
    draft_ids = t2d.nonzero().squeeze(1)
    torch.manual_seed(seed)
    model = Eagle3Draft(DraftConfig.from_target(tiny_config(), num_aux=3, draft_vocab_size=len(draft_ids)))
    for p in model.parameters():  # norms too, so that every weight matters
        torch.nn.init.normal_(p, std=0.3 if p.dim() == 1 else 0.08, generator=g)
    with torch.no_grad():
        model.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        model.t2d.copy_(t2d)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(model.midlayer, name).weight.add_(1.0)
        model.norm.weight.add_(1.0)
    head = torch.randn(v, h, generator=g)
    batch = Batch(
        aux_hidden=torch.randn(b, t, 3 * h, generator=g),
        last_hidden=torch.randn(b, t, h, generator=g),
        input_ids=torch.randint(0, v, (b, t), generator=g),
        loss_mask=torch.rand(b, t, generator=g) < 0.8,
        lengths=torch.tensor([t - 4 * (i % 2) for i in range(b)]),
        sample_ids=torch.arange(b),
    )
    return model, head, t2d, batch


def reference_step_loss(logits, target, mask, objective):
    """One step's loss written out from its definition: the target smoothed, the unsure positions
    left out, (1 - w) soft cross-entropy + w (-log sum min(p, q)), the mean over what is left."""
    target = (1 - objective.label_smoothing) * target + objective.label_smoothing / target.shape[-1]
    mask = mask & (target.max(-1).values >= objective.min_target_prob) if objective.min_target_prob else mask
    q = logits.softmax(-1)
    per = -(1 - objective.lk_weight) * (target * q.log()).sum(-1)
    per = per - objective.lk_weight * torch.minimum(q, target).sum(-1).log()
    return (per * mask).sum() / mask.sum().clamp(min=1)


def dense_reference_loss(model, batch, head, t2d, objective=None):
    """The TTT loss as the issue's reference has it: every step's keys side by side under the dense
    mask (step 0 causal, steps 1..j on the diagonal), whole logits, soft cross-entropy per step
    (or the step loss ``objective`` defines, :func:`reference_step_loss`)."""
    b, t = batch.input_ids.shape
    layer, attn = model.midlayer, model.midlayer.self_attn
    nh, nkv, d = attn.num_heads, attn.num_kv, attn.head_dim
    target = (batch.last_hidden @ head.T)[..., t2d].softmax(-1)  # [B, T, V_draft]
    top = (batch.last_hidden @ head.T).argmax(-1)
    hidden, keys, values, total = model.fc(batch.aux_hidden), [], [], 0.0
    for j in range(TTT):
        ids = F.pad(batch.input_ids[:, 1 + j :], (0, 1 + j))[:, :t]
        cos, sin = model.rotary_emb(hidden, torch.arange(t).expand(b, t) + j)
        x = torch.cat([layer.input_layernorm(model.embed_tokens(ids)), layer.hidden_norm(hidden)], -1)
        q = apply_rope(attn.q_proj(x).view(b, t, nh, d).transpose(1, 2), cos, sin)
        keys.append(
            apply_rope(attn.k_proj(x).view(b, t, nkv, d).transpose(1, 2), cos, sin).repeat_interleave(nh // nkv, 1)
        )
        values.append(attn.v_proj(x).view(b, t, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, 1))
        mask = torch.cat([torch.ones(t, t).tril()] + [torch.eye(t)] * j, dim=1).bool()  # [T, T*(j+1)]
        scores = (q @ torch.cat(keys, 2).transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
        out = (scores.softmax(-1) @ torch.cat(values, 2)).transpose(1, 2).reshape(b, t, nh * d)
        h1 = hidden + attn.o_proj(out)
        hidden = h1 + layer.mlp(layer.post_attention_layernorm(h1))
        n = t - 2 - j
        pos = torch.arange(n)
        counted = (pos[None] + 2 + j < batch.lengths[:, None]) & batch.loss_mask[:, 2 + j :]
        loss_mask = counted & t2d[top[:, 1 + j : 1 + j + n]]
        logits = model.lm_head(model.norm(hidden[:, :n]))
        args = logits.reshape(b * n, -1), target[:, 1 + j : 1 + j + n].reshape(b * n, -1), loss_mask.reshape(-1)
        if objective is None:
            total = total + DECAY**j * soft_cross_entropy(*args)
        else:
            total = total + DECAY**j * reference_step_loss(*args, objective)
    return total


def loss_and_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_chunk, checkpointing, compiled_head",
    [(0, False, False), (5, False, False), (7, True, False), (1000, True, False), (6, False, True)],
)
def test_ttt_loss_and_gradients_equal_the_dense_reference(head_chunk, checkpointing, compiled_head):
    model, head, t2d, batch = tiny_problem()
    want = loss_and_grads(model, dense_reference_loss(model, batch, head, t2d))
    if checkpointing:
        apply_activation_checkpointing(model)
    loss, stats = ttt_losses(model, batch, head, t2d, TTT, DECAY, head_chunk=head_chunk, compiled_head=compiled_head)
    assert_same(loss_and_grads(model, loss), want)
    assert stats[:, 2].sum() > 0 and stats[-1, 2] < stats[0, 2]


LK, MIXED, SURE = (
    Objective(lk_weight=1.0),
    Objective(lk_weight=0.4, label_smoothing=0.1),
    Objective(min_target_prob=0.6),
)


# the mask option is the same code whatever the head; the loss terms are checked through each head
@pytest.mark.slow
@pytest.mark.parametrize(
    "objective, head_chunk, compiled_head",
    [(LK, 0, False), (LK, 5, False), (MIXED, 0, False), (MIXED, 5, False), (MIXED, 6, True), (SURE, 5, False)],
    ids=[
        "lk-whole",
        "lk-fused",
        "mixed_smoothed-whole",
        "mixed_smoothed-fused",
        "mixed_smoothed-compiled",
        "sure_only",
    ],
)
def test_ttt_loss_of_each_objective_equals_its_definition(objective, head_chunk, compiled_head):
    """objective.lk_weight, objective.label_smoothing and objective.min_target_prob: the TTT loss and its
    gradients (whole logits, the fused head, the compiled fused head) equal the dense reference
    with the step loss written out from its definition; accuracy still counts every position."""
    model, head, t2d, batch = tiny_problem()
    want = loss_and_grads(model, dense_reference_loss(model, batch, head, t2d, objective))
    kw = {"head_chunk": head_chunk, "compiled_head": compiled_head}
    loss, stats = ttt_losses(model, batch, head, t2d, TTT, DECAY, objective=objective, **kw)
    assert_same(loss_and_grads(model, loss), want)
    _, plain = ttt_losses(model, batch, head, t2d, TTT, DECAY, **kw)
    assert torch.equal(stats[:, :3], plain[:, :3])
    if objective.min_target_prob:  # the threshold leaves some positions out, not all
        everything = loss_and_grads(model, dense_reference_loss(model, batch, head, t2d))[0]
        assert loss.item() > 0 and not torch.isclose(loss.detach(), everything)


def test_head_loss_is_the_unfused_loss():
    """Loss, argmax and gradients of the fused head equal whole logits through autograd, for
    chunks that do and do not divide the positions, a frozen weight, and without gradients."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(11, 16, generator=g, requires_grad=True), torch.randn(40, 16, generator=g, requires_grad=True)
    p = torch.randn(11, 40, generator=g).softmax(-1)
    mask = torch.rand(11, generator=g) < 0.7
    logits = x @ w.T
    want = soft_cross_entropy(logits, p, mask, torch.tensor(20))
    want_grads = torch.autograd.grad(want, (x, w))
    for chunk in (1, 4, 11, 64):
        got, pred = head_loss(x, w, p, mask, torch.tensor(20), chunk)
        torch.testing.assert_close(got, want)
        assert torch.equal(pred, logits.argmax(-1))
        for a, b in zip(torch.autograd.grad(3 * got, (x, w)), want_grads, strict=True):
            torch.testing.assert_close(a, 3 * b)
    frozen = w.detach()
    got, _ = head_loss(x, frozen, p, mask, chunk=4)
    torch.testing.assert_close(
        torch.autograd.grad(got, x)[0], torch.autograd.grad(soft_cross_entropy(x @ frozen.T, p, mask), x)[0]
    )
    with torch.no_grad():
        assert not head_loss(x, w, p, mask, chunk=4)[0].requires_grad


def test_fused_lk_gradient_is_autograds_also_below_the_acceptance_floor():
    """objective.lk_weight=1 where one position's draft gives the target's token almost no mass
    (sum min(p, q) < ALPHA_FLOOR): the loss is held at -log(floor) there, and the fused head's
    gradient is autograd's through that clamp (0 from that position)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=g)
    w = torch.randn(10, 8, generator=g)
    w[0] = -6 * x[0]  # position 0's logit for token 0 is about -6 |x0|^2
    p = torch.randn(4, 10, generator=g).softmax(-1)
    p[0] = F.one_hot(torch.tensor(0), 10).float()
    x.requires_grad_(True), w.requires_grad_(True)
    mask = torch.ones(4, dtype=torch.bool)
    assert torch.softmax(x[0] @ w.T, -1)[0] < ALPHA_FLOOR
    want = lk_loss(x @ w.T, p, mask)
    got, _ = head_loss(x, w, p, mask, chunk=3, lk_weight=1.0)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w)), strict=True):
        torch.testing.assert_close(a, b)
    assert torch.autograd.grad(head_loss(x[:1], w, p[:1], mask[:1], chunk=3, lk_weight=1.0)[0], x)[0].abs().max() == 0


def test_compiled_head_loss_is_the_unfused_loss():
    """runtime.compile's head loss (the per-chunk math through torch.compile) gives the loss, argmax
    and gradients of whole logits through autograd, for chunk lengths that vary (one dynamic graph)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(13, 16, generator=g, requires_grad=True), torch.randn(40, 16, generator=g, requires_grad=True)
    p = torch.randn(13, 40, generator=g).softmax(-1) * (torch.rand(13, 1, generator=g) < 0.8)  # rows without a target
    mask = torch.rand(13, generator=g) < 0.7
    logits = x @ w.T
    want = soft_cross_entropy(logits, p, mask, torch.tensor(20))
    want_grads = torch.autograd.grad(want, (x, w))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compile afresh, whichever test compiled it before
    frames = counters["frames"]["ok"]
    for chunk in (5, 13):
        got, pred = head_loss(x, w, p, mask, torch.tensor(20), chunk, compiled=True)
        torch.testing.assert_close(got, want)
        assert torch.equal(pred, logits.argmax(-1))
        for a, b in zip(torch.autograd.grad(got, (x, w)), want_grads, strict=True):
            torch.testing.assert_close(a, b)
    assert counters["frames"]["ok"] > frames  # it ran compiled, not eager


def test_compiled_layer_has_two_graphs_per_grad_mode_for_every_step_and_shape():
    """runtime.compile: the decoder layer's two step-independent parts compile once each for training
    and once each for the no-grad eval, whatever the TTT step and the batch's rows and lengths; the
    compiled layer gives the eager layer's loss and gradients."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    graphs = CompileCounter()
    model, head, t2d, _ = tiny_problem()
    eager, _, _, _ = tiny_problem()
    apply_compile(model, backend=graphs)
    for grad, shapes in ((True, ((2, 13), (3, 9), (2, 11))), (False, ((2, 13), (4, 7)))):
        with torch.set_grad_enabled(grad):
            for b, t in shapes:
                batch = tiny_problem(t=t, b=b)[3]
                loss, _ = ttt_losses(model, batch, head, t2d, TTT, DECAY)
                want, _ = ttt_losses(eager, batch, head, t2d, TTT, DECAY)
                torch.testing.assert_close(loss, want)
                if grad:
                    trained = [[p for p in m.parameters() if p.requires_grad] for m in (model, eager)]
                    for a, r in zip(
                        torch.autograd.grad(loss, trained[0]), torch.autograd.grad(want, trained[1]), strict=True
                    ):
                        torch.testing.assert_close(a, r)
        assert graphs.frame_count == 2 * (1 if grad else 2)


def saved_activations(t, **options):
    """Bytes autograd keeps for backward over one TTT loss (7 steps) with rows of ``t`` positions
    (the weights and the batch excluded), and whether any of it is a [positions, V_draft] tensor."""
    model, head, t2d, batch = tiny_problem(t=t, b=1)
    if options.pop("checkpointing", False):
        apply_activation_checkpointing(model)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {x.untyped_storage().data_ptr() for x in (batch.aux_hidden, batch.last_hidden)}
    seen, logits = {}, False
    v = model.config.draft_vocab_size

    def pack(x):
        nonlocal logits
        if x.untyped_storage().data_ptr() not in skip:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            logits |= x.dim() > 0 and x.shape[-1] == v and x.numel() >= (t - 8) * v
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_losses(model, batch, head, t2d, 7, DECAY, **options)
    return sum(seen.values()), logits


def test_saved_activations_grow_linearly_and_options_shrink_them():
    """What backward keeps is affine in the sequence length (from 32 to 64 positions it grows by
    half what it grows from 64 to 128: no [T, T] tensor, on the CPU too); the fused head keeps no
    step's [T, V_draft] logits; checkpointing the layer keeps a fraction of the rest."""
    slope = {}
    for name, options in (
        ("plain", {}),
        ("fused", {"head_chunk": 16}),
        ("ckpt", {"head_chunk": 16, "checkpointing": True}),
    ):
        (a, _), (b, _), (c, logits) = (saved_activations(t, **options) for t in (32, 64, 128))
        assert c - b == pytest.approx(2 * (b - a), rel=0.01), name
        assert logits == (name == "plain")
        slope[name] = (c - b) / 64  # bytes per position
    assert slope["fused"] < 0.9 * slope["plain"] and slope["ckpt"] < 0.2 * slope["fused"]


def test_memory_options_are_checked():
    """ZeRO-3 does not gather lm_head for the fused head: deepspeed=zero3 turns it off, asking for
    both is refused; sequence parallelism must divide the heads; the new numbers are range-checked."""
    from eagle3_train.core.cli import to_config
    from test_configs import compose_config

    cfg = to_config(compose_config("train.yaml", ["data=d", "out=o", "deepspeed=zero3"]), TrainConfig)
    assert (cfg.deepspeed.zero_stage, cfg.runtime.head_chunk) == (3, 0)
    with pytest.raises(ConfigError, match="ZeRO-3 does not gather"):
        to_config(
            compose_config("train.yaml", ["data=d", "out=o", "deepspeed=zero3", "runtime.head_chunk=512"]), TrainConfig
        )
    with pytest.raises(ConfigError, match="ZeRO-3 does not gather"):
        TrainConfig(data="d", out="o", deepspeed=DeepSpeedConfig(zero_stage=3))
    with pytest.raises(ConfigError, match=r"sequence_parallel=4 must divide the draft's key/value heads \(2\)"):
        apply_sequence_parallel(tiny_problem()[0], SequenceParallel(None, 0, 4))  # 4 heads, 2 kv heads
    for field, value in (("head_chunk", -1), ("sequence_parallel", 0)):
        with pytest.raises(ConfigError, match=rf"^runtime\.{field} must be"):
            RuntimeConfig(**{field: value})


@pytest.mark.slow
def test_sequence_parallel_two_ranks_equal_one():
    """2 ranks (gloo, fp32) share each row's positions; summed over the ranks, their losses,
    statistics, gradients and per-position hits are the one-rank reference's, for rows whose length
    the group does not divide (padded), with the fused head and with checkpointing."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "sp_worker"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("sp ok") == 2 * 4, run.stdout[-2000:]
