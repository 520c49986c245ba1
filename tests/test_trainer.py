"""eagle3-train on standardized dumps of the tiny target."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, Eagle3Error
from eagle3_train.serving.export import ExportConfig, Exporter, run_sha256
from eagle3_train.training.budget import WallClockBudget
from eagle3_train.training.checkpoint import BestTracker
from eagle3_train.training.config import (
    RENAMED,
    DeepSpeedConfig,
    LoggingConfig,
    LoopConfig,
    ModelOptions,
    OptimConfig,
    TrainConfig,
    lr_factor,
)
from eagle3_train.training.data import batch_plan, plan_epoch
from eagle3_train.training.ema import EMA_FILE, WeightAverage
from eagle3_train.training.tracking import TRACKER_FILE
from eagle3_train.training.trainer import Trainer
from test_standardize import make_dump
from train_options import train_sections


def standardized(dump, out, draft_vocab_size):
    Standardizer(
        StandardizeConfig(
            dumps=[str(dump)], out=str(out), draft_vocab_size=draft_vocab_size, eval_fraction=0.15, progress=False
        )
    ).run()
    return out


@pytest.fixture(scope="module")
def std(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return standardized(make_dump(root, "d", n=48), root / "std", 320)


def train(std, out, **opt):
    """A run on the tiny target; ``source=online`` with ``prepared=PreparedConfig(...)`` runs it in the loop."""
    zero = opt.pop("zero_stage", 1)
    model, target = opt.pop("model", ModelOptions()), opt.pop("target", "tiny")
    source = {k: opt.pop(k) for k in ("source", "prepared", "online", "engine") if k in opt}
    o = train_sections(
        **({"ttt_length": 3, "lr": 3e-3, "max_tokens_per_batch": 600, "log_every": 1, "epochs": 2} | opt)
    )
    t = Trainer(
        TrainConfig(
            data=str(std),
            target=target,
            out=str(out),
            **o,
            model=model,
            progress=False,
            deepspeed=DeepSpeedConfig(zero_stage=zero),
            **source,
        )
    )
    try:
        return t.run()
    finally:
        t.close()


def last_checkpoint(out: Path) -> Path:
    return sorted((out / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))[-1]


def killed_after_step_5_and_resumed(std, out: Path, monkeypatch, **opt) -> dict:
    """A run (``save_every=2``) killed after its step 5, so its last checkpoint is step 4, then run
    again to its end: the draft it ends with."""
    steps = iter(range(1, 100))

    def killed_after_step_5(point):
        if point == "train.step" and next(steps) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr("eagle3_train.training.trainer.fault_point", killed_after_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(std, out, save_every=2, **opt)
    monkeypatch.undo()
    assert last_checkpoint(out).name == "step4"
    train(std, out, save_every=2, **opt)
    return load_file(str(last_checkpoint(out) / "draft.safetensors"))


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_learns_the_target(std, tmp_path):
    final = train(std, tmp_path / "r", epochs=12)
    logged = [m for m in metrics(tmp_path / "r") if "loss" in m]
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert final["eval_acc"][0] > 0.3  # chance is 1/320
    assert final["eval_tau"] > 1.5
    # the decode walk counts the same hits along the positions a decode visits: near the simulation
    assert final["eval_tau_decoded"] > 1.3 and abs(final["eval_tau_decoded"] - final["eval_tau"]) < 0.25
    ck = tmp_path / "r" / "checkpoints" / f"step{final['step']}"
    weights = load_file(str(ck / "draft.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["fc.weight"].shape == (64, 192)
    assert torch.equal(weights["d2t"], torch.zeros(320, dtype=torch.int64))  # full vocab: identity map


def test_lr_schedule():
    o = OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [round(lr_factor(s, 10, o), 3) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    assert lr_factor(6, 10, OptimConfig(schedule="linear")) == pytest.approx(0.4)
    # warmup-stable-decay: warmup 2, the peak through step 7 of 12 (half of the 10 after warmup), then linear to 0.1
    wsd = OptimConfig(warmup_steps=2, schedule="wsd", decay_fraction=0.5, min_lr_ratio=0.1)
    assert [round(lr_factor(s, 12, wsd), 3) for s in (0, 1, 2, 7, 8, 9, 12)] == [0.5, 1.0, 1.0, 1.0, 0.82, 0.64, 0.1]
    with pytest.raises(ConfigError, match="optim.decay_fraction must be in"):
        OptimConfig(schedule="wsd", decay_fraction=0.0)


def test_warmup_fraction_is_a_share_of_the_runs_steps():
    """optim.warmup_fraction: the warmup of a run of N steps is round(fraction x N) (at least 1), and the
    schedule after it is the one warmup_steps of that count gives; a shorter run warms up for fewer steps."""
    frac = OptimConfig(warmup_fraction=0.0134, schedule="wsd", min_lr_ratio=0.1)
    for total, warmup in ((2246, 30), (42, 1), (10, 1), (300, 4)):
        steps = OptimConfig(warmup_steps=warmup, schedule="wsd", min_lr_ratio=0.1)
        assert [lr_factor(s, total, frac) for s in range(total + 1)] == [
            lr_factor(s, total, steps) for s in range(total + 1)
        ]
    assert lr_factor(0, 42, frac) == 1.0  # one warmup step: the peak at once
    assert lr_factor(0, 2246, frac) == pytest.approx(1 / 30)
    with pytest.raises(ConfigError, match="optim.warmup_steps=5 and optim.warmup_fraction=0.1 both set"):
        OptimConfig(warmup_steps=5, warmup_fraction=0.1)
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="optim.warmup_fraction must be in"):
            OptimConfig(warmup_fraction=bad)


def test_min_steps_shrinks_the_micro_batches_to_the_largest_budget_that_gives_them():
    """loop.min_steps: where the epochs hold fewer steps at loop.max_tokens_per_batch, the budget is the
    largest whose epochs (counted by plan_epoch itself, 2 ranks) hold that many; one sample per micro-batch
    is the most a split gives; loop.max_steps caps the steps asked for; a resumed run keeps the budget it
    began with."""
    lengths = np.random.default_rng(0).integers(20, 400, 300)

    def steps_at(budget, epochs=2, world=2):
        return sum(len(plan_epoch(lengths, budget, 0, e)) // world for e in range(epochs))

    o = LoopConfig(max_tokens_per_batch=4096, epochs=2)
    plain = batch_plan(lengths, o, 2)
    assert plain.tokens == 4096 and sum(plain.epoch_steps) == steps_at(4096) == plain.steps_at_max
    assert plain.note(o) is None
    want = 4 * steps_at(4096)
    o = LoopConfig(max_tokens_per_batch=4096, epochs=2, min_steps=want)
    p = batch_plan(lengths, o, 2)
    assert p.tokens < 4096 and sum(p.epoch_steps) == steps_at(p.tokens) >= want > steps_at(p.tokens + 1)
    assert p.steps_at_max == steps_at(4096)
    assert f"micro-batches hold at most {p.tokens} tokens: {sum(p.epoch_steps)} steps" in p.note(o)
    for b in plan_epoch(lengths, p.tokens, 0, 1):  # a micro-batch of several samples stays within the budget
        assert len(b) == 1 or len(b) * lengths[b].max() <= p.tokens
    o = LoopConfig(max_tokens_per_batch=4096, epochs=2, min_steps=10_000)
    p = batch_plan(lengths, o, 2)
    assert p.tokens == 1 and p.epoch_steps == [150, 150]
    assert "one sample per micro-batch gives 300, the most this split holds" in p.note(o)
    p = batch_plan(lengths, LoopConfig(max_tokens_per_batch=4096, epochs=3, min_steps=want), 2, tokens=1000)
    assert p.tokens == 1000 and sum(p.epoch_steps) == steps_at(1000, epochs=3)
    # counted up to loop.max_steps: a run cut shorter keeps its batches unless the epochs hold fewer steps
    capped = LoopConfig(max_tokens_per_batch=4096, epochs=2, min_steps=want, max_steps=steps_at(4096))
    assert batch_plan(lengths, capped, 2).tokens == 4096
    capped = LoopConfig(max_tokens_per_batch=4096, epochs=2, min_steps=want, max_steps=2 * steps_at(4096))
    p = batch_plan(lengths, capped, 2)
    assert steps_at(p.tokens) >= 2 * steps_at(4096) > steps_at(p.tokens + 1)


def test_min_steps_trains_on_smaller_batches_and_a_resumed_run_keeps_them(std, tmp_path, said):
    """A run that min_steps gave smaller micro-batches records their budget; raising loop.epochs continues
    with the same batches (not the budget min_steps would now pick) and gives the weights of a run trained
    straight with that budget as loop.max_tokens_per_batch (constant lr)."""
    run = tmp_path / "r"
    said()
    train(std, run, epochs=1, min_steps=8, schedule="constant")
    m = re.search(
        r"loop.min_steps=8: the epochs hold (\d+) steps at loop.max_tokens_per_batch=600, so micro-batches "
        r"hold at most (\d+) tokens: (\d+) steps",
        said(),
    )
    assert m, "no min_steps line"
    held, began, steps = int(m[1]), int(m[2]), int(m[3])
    assert held < 8 <= steps and began < 600
    assert metrics(run)[-1]["step"] == steps
    state = json.loads((run / "checkpoints" / f"step{steps}" / "state.json").read_text())
    assert state["batch_tokens"] == began
    train(std, run, epochs=2, min_steps=8, schedule="constant")
    assert f"continues with the micro-batches it began with (at most {began} tokens" in said()
    final = metrics(run)[-1]["step"]
    straight = train(std, tmp_path / "straight", epochs=2, max_tokens_per_batch=began, schedule="constant")
    assert straight["step"] == final
    last = lambda d: load_file(str(d / "checkpoints" / f"step{final}" / "draft.safetensors"))  # noqa: E731
    a, b = last(run), last(tmp_path / "straight")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)


def test_recipe_options_are_checked():
    with pytest.raises(ConfigError, match="would freeze a random lm_head"):
        ModelOptions(freeze_lm_head=True)
    with pytest.raises(ConfigError, match="lm_head_init must be random or target"):
        ModelOptions(lm_head_init="tied")
    with pytest.raises(ConfigError, match="early_stop_patience counts evaluations: set loop.eval_every"):
        LoopConfig(early_stop_patience=2)
    with pytest.raises(ConfigError, match="optim.ema_decay averages whole weights, which ZeRO-3 partitions"):
        TrainConfig(
            data="d", out="o", **train_sections(ema_decay=0.99, head_chunk=0), deepspeed=DeepSpeedConfig(zero_stage=3)
        )


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", -1.0),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("weight_decay", -0.1),
        ("betas", [0.9, 1.0]),
        ("betas", [-0.1, 0.95]),
        ("betas", [0.9]),
        ("grad_clip", -1.0),
        ("warmup_steps", -1),
        ("epochs", 0),
        ("max_steps", 0),
        ("min_lr_ratio", 1.5),
        ("min_lr_ratio", -0.1),
        ("max_tokens_per_batch", 0),
        ("grad_accum", 0),
        ("ttt_length", 0),
        ("loss_decay", 0.0),
        ("loss_decay", 1.1),
        ("eval_every", -1),
        ("save_every", -1),
        ("keep_last", 0),
        ("log_every", 0),
        ("cache_target_gb", -1.0),
        ("early_stop_patience", -1),
        ("lk_weight", 1.5),
        ("label_smoothing", -0.1),
        ("min_target_prob", 2.0),
        ("ema_decay", 1.0),
        ("decay_fraction", 0.0),
        ("min_steps", -1),
    ],
)
def test_numeric_recipe_options_are_range_checked(field, value):
    section = RENAMED[f"train.{field}"].split(".")[0]
    with pytest.raises(ConfigError, match=rf"^{section}\.{field} must be") as e:
        train_sections(**{field: value})
    assert "\n" not in str(e.value)


def test_numeric_recipe_options_accept_their_bounds():
    o = train_sections(
        lr=1e-9,
        weight_decay=0.0,
        betas=[0.0, 0.999],
        grad_clip=0.0,
        warmup_steps=0,
        max_steps=1,
        min_lr_ratio=1.0,
        loss_decay=1.0,
        cache_target_gb=0.0,
        lk_weight=1.0,
        label_smoothing=1.0,
        min_target_prob=1.0,
        ema_decay=0.0,
        decay_fraction=1.0,
    )
    assert o["optim"].grad_clip == 0.0 and o["optim"].min_lr_ratio == 1.0
    with pytest.raises(ConfigError, match=r"^deepspeed\.zero_stage must be 0, 1, 2 or 3, got 4$"):
        DeepSpeedConfig(zero_stage=4)


def test_ttt_statistics_count_out_of_vocab_positions_as_misses():
    """ttt_losses' per-step counts against loops over a hand-built batch: every existing,
    loss-masked position is counted; one whose target argmax is outside the draft vocab is a miss;
    a hit is the draft's pick, mapped through d2t, equal to the target's full-vocab argmax."""
    from eagle3_train.model import DraftConfig, Eagle3Draft
    from eagle3_train.targets.tiny import tiny_config
    from eagle3_train.training.data import Batch
    from eagle3_train.training.ttt import ttt_losses

    g = torch.Generator().manual_seed(0)
    b, t, h, v, ttt = 2, 12, 64, 320, 3
    t2d = torch.arange(v) % 3 != 0  # a third of the target vocab is outside the draft vocab
    draft_ids = t2d.nonzero().squeeze(1)
    d2t = draft_ids - torch.arange(len(draft_ids))
    head = torch.randn(v, h, generator=g)
    batch = Batch(
        aux_hidden=torch.randn(b, t, 3 * h, generator=g),
        last_hidden=torch.randn(b, t, h, generator=g),
        input_ids=torch.randint(0, v, (b, t), generator=g),
        loss_mask=torch.rand(b, t, generator=g) < 0.8,
        lengths=torch.tensor([t, t - 3]),
        sample_ids=torch.tensor([0, 1]),
    )
    model = Eagle3Draft(DraftConfig.from_target(tiny_config(), num_aux=3, draft_vocab_size=len(draft_ids)))
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    target_logits = batch.last_hidden @ head.T  # [B, T, V]
    # The draft's logits at step j: the target's own at t+1+j over the draft vocab, plus noise, so
    # that some in-vocab positions are hits and some are not. Fed in place of the head's output.
    picks = []

    def scripted_logits(out):
        j, n = len(picks), out.shape[1]
        logits = target_logits[:, 1 + j : 1 + j + n][..., draft_ids] + 2.0 * torch.randn(
            b, n, len(draft_ids), generator=g
        )
        picks.append(logits.argmax(-1))
        return logits

    model.logits = scripted_logits
    _, stats = ttt_losses(model, batch, head, t2d, ttt, 0.8)
    for j in range(ttt):
        hits = in_vocab = counted = 0
        for row in range(b):
            for pos in range(t - 2 - j):  # predicts token pos+2+j from the target at pos+1+j
                if pos + 2 + j >= int(batch.lengths[row]) or not batch.loss_mask[row, pos + 2 + j]:
                    continue
                counted += 1
                want = int(target_logits[row, pos + 1 + j].argmax())
                in_vocab += bool(t2d[want])
                pick = int(picks[j][row, pos])
                hits += pick + int(d2t[pick]) == want
        assert stats[j, :3].tolist() == [hits, in_vocab, counted]
        assert 0 < hits < in_vocab < counted  # the case is not degenerate


# train()'s recipe as command-line overrides
TINY_ARGS = [
    "progress=false",
    "objective.ttt_length=3",
    "optim.lr=3e-3",
    "loop.max_tokens_per_batch=600",
    "loop.log_every=1",
    "loop.epochs=2",
]


def _torchrun(std, out, nproc, extra=(), env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "eagle3_train.training.trainer",
        f"data={std}",
        "target=tiny",
        f"out={out}",
        *TINY_ARGS,
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch(std, tmp_path):
    """Data parallel (2 ranks x grad_accum 1) and sequence parallel (2 ranks sharing each row,
    grad_accum 2) train as 1 rank x grad_accum 2: same losses, accuracies, evaluations, weights."""
    train(std, tmp_path / "one", grad_accum=2)  # the one-rank reference, in this process
    two = _torchrun(std, tmp_path / "two", 2, ["loop.grad_accum=1"])
    assert two.returncode == 0, two.stderr[-3000:]
    sp = _torchrun(
        std, tmp_path / "sp", 2, ["loop.grad_accum=2", "runtime.sequence_parallel=2", "runtime.head_chunk=100"]
    )
    assert sp.returncode == 0, sp.stderr[-3000:]
    a = [m for m in metrics(tmp_path / "one") if "loss" in m]
    wa = load_file(str(sorted((tmp_path / "one" / "checkpoints").glob("step*"))[-1] / "draft.safetensors"))
    for run in ("two", "sp"):
        b = [m for m in metrics(tmp_path / run) if "loss" in m]
        assert len(a) == len(b) > 3
        for x, y in zip(a, b):
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
            assert x["acc"] == pytest.approx(y["acc"], abs=1e-6)
        wb = load_file(str(sorted((tmp_path / run / "checkpoints").glob("step*"))[-1] / "draft.safetensors"))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=1e-3)
    evals = [[m for m in metrics(tmp_path / run) if "eval_loss" in m] for run in ("one", "sp")]
    assert evals[0][-1]["eval_loss"] == pytest.approx(evals[1][-1]["eval_loss"], rel=1e-4)
    assert evals[0][-1]["eval_acc"] == pytest.approx(evals[1][-1]["eval_acc"], abs=1e-6)
    walked = [
        [m["eval_tau_decoded"] for m in metrics(tmp_path / run) if "eval_loss" in m] for run in ("one", "two", "sp")
    ]
    assert walked[0] == walked[1] == walked[2] and walked[0][-1] >= 1


def test_weight_average_is_what_is_evaluated_exported_and_resumed(std, tmp_path, monkeypatch):
    """optim.ema_decay: training itself is untouched (the same losses as without it); the
    checkpoints hold the average as draft.safetensors, with the average and its update count beside
    them; a run stopped after step 5 resumes from step 4 to the same average as the whole run."""
    plain = train(std, tmp_path / "plain", save_every=2)
    whole = train(std, tmp_path / "whole", save_every=2, ema_decay=0.9)
    train_lines = lambda d: [r for r in metrics(d) if "loss" in r and "eval_acc" not in r]  # noqa: E731
    assert [r["loss"] for r in train_lines(tmp_path / "whole")] == [r["loss"] for r in train_lines(tmp_path / "plain")]
    assert whole["eval_tau"] != plain["eval_tau"]
    ema = load_file(str(last_checkpoint(tmp_path / "whole") / "ema.safetensors"))
    assert int(ema.pop("__updates__")) == whole["step"]
    draft = load_file(str(last_checkpoint(tmp_path / "whole") / "draft.safetensors"))
    raw = load_file(str(last_checkpoint(tmp_path / "plain") / "draft.safetensors"))
    assert set(ema) <= set(draft) and "fc.weight" in ema
    for k in ema:
        assert torch.equal(draft[k], ema[k].to(draft[k].dtype))
    assert not torch.equal(draft["fc.weight"], raw["fc.weight"])
    assert torch.equal(draft["d2t"], raw["d2t"])  # what is not trained is not averaged

    again = killed_after_step_5_and_resumed(std, tmp_path / "cut", monkeypatch, ema_decay=0.9)
    for k in draft:
        torch.testing.assert_close(again[k], draft[k], atol=1e-6, rtol=1e-6)


def test_weight_average_update_by_hand(tmp_path):
    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    avg = WeightAverage(layer, decay=0.5)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    avg.update()  # d_1 = min(0.5, 2/11) = 2/11: 1 + (1 - 2/11) * (3 - 1)
    assert avg.average["weight"].item() == pytest.approx(1 + 18 / 11)
    with avg.applied():
        assert layer.weight.item() == pytest.approx(1 + 18 / 11)
    assert layer.weight.item() == 3.0
    with pytest.raises(
        ContractError, match=r"ema.safetensors: the weight average of optim.ema_decay=0.5 cannot be read"
    ):
        avg.load(tmp_path)  # a checkpoint without it
    save_file({"other": torch.zeros(1), "__updates__": torch.tensor(1)}, str(tmp_path / EMA_FILE))
    with pytest.raises(ContractError, match=r"holds the average of \['other'\].*this draft trains \['weight'\]"):
        avg.load(tmp_path)
    save_file(avg.state(), str(tmp_path / EMA_FILE))
    avg.updates = 0
    avg.load(tmp_path)
    assert avg.updates == 1


def test_resume_refuses_another_vocab_map(std, tmp_path):
    import shutil

    data = tmp_path / "std"
    shutil.copytree(std, data)
    train(data, tmp_path / "r", max_steps=2)
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["stage"] == "train" and manifest["step"] == 2 and manifest["request"]["micro_batches_per_step"] == 1
    with pytest.raises(
        ContractError,
        match=r"(?s)\n  micro_batches_per_step: 1 != 2\n"
        r"  options.loop.grad_accum: 1 != 2\nkeep ranks x loop.grad_accum",
    ):
        train(data, tmp_path / "r", max_steps=4, grad_accum=2)
    Standardizer(StandardizeConfig(out=str(data), only_vocab=True, draft_vocab_size=200, progress=False)).run()
    with pytest.raises(
        ContractError,
        match=r"(?s)holds a finished training run made otherwise.*\n  vocab_sha256: .*vocab_map=<the old map>",
    ):
        train(data, tmp_path / "r", max_steps=4)


def test_a_rerun_with_a_changed_option_is_refused_by_name(std, tmp_path, said):
    """Every option that changes the weights is in the run's request (core.fingerprint): a rerun
    that changes one is refused naming it; an option listed as outside the request (how often it
    logs) is taken; raising max_steps extends the run, says so, and with a constant lr gives the
    weights of a run trained straight to the new total."""
    run = tmp_path / "r"
    train(std, run, max_steps=2, schedule="constant")
    for change, field in (
        ({"lr": 1e-3}, r"options.optim.lr: 0.003 != 0.001"),
        ({"ttt_length": 2}, r"options.objective.ttt_length: 3 != 2"),
        ({"seed": 1}, r"options.loop.seed: 0 != 1"),
        ({"schedule": "cosine"}, r"options.optim.schedule: 'constant' != 'cosine'"),
    ):
        with pytest.raises(
            ContractError,
            match=rf"(?s)holds a finished training run made otherwise.*\n  {field}\n"
            r".*only with the options it was started with",
        ):
            train(std, run, **({"max_steps": 2, "schedule": "constant"} | change))
    said()
    train(std, run, max_steps=2, schedule="constant", log_every=5)  # outside the request: nothing to do
    assert "already trained at step 2; nothing to do" in said()
    train(std, run, max_steps=4, schedule="constant")
    assert "loop.max_steps: 2 -> 4: the run continues from step 2 to 4 (was 2)" in said()
    train(std, tmp_path / "straight", max_steps=4, schedule="constant")
    last = lambda d: load_file(str(d / "checkpoints" / "step4" / "draft.safetensors"))  # noqa: E731
    a, b = last(run), last(tmp_path / "straight")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
    assert json.loads((run / "manifest.json").read_text())["step"] == 4


@pytest.mark.slow
def test_a_sweep_runs_each_job_in_its_own_process_and_directory(std, tmp_path):
    """``eagle3-train -m ... optim.lr=a,b``: the second job failed on DeepSpeed state left by the
    first, and both wrote one out=. Now each job runs in its own process, in <out>/<swept options>,
    with the weights of a plain run at its lr."""
    sweep = tmp_path / "sweep"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3_train.training.trainer",
            "-m",
            f"data={std}",
            "target=tiny",
            f"out={sweep}",
            "objective.ttt_length=3",
            "loop.max_tokens_per_batch=600",
            "loop.epochs=2",
            "loop.max_steps=1",
            "optim.lr=1e-3,3e-3",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml", "optim.lr=0.001", "optim.lr=0.003"]
    for lr in (1e-3, 3e-3):
        assert json.loads((sweep / f"optim.lr={lr}" / "config.json").read_text())["optim"]["lr"] == lr
    # the second job (the one that failed on the first's DeepSpeed state) against a plain run
    train(std, tmp_path / "plain", max_steps=1, lr=3e-3, log_every=10)
    a = load_file(str(sweep / "optim.lr=0.003" / "checkpoints" / "step1" / "draft.safetensors"))
    b = load_file(str(tmp_path / "plain" / "checkpoints" / "step1" / "draft.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)


def test_export_refuses_an_unfinished_run_and_another_runs_export(std, tmp_path):
    """A run without its final manifest (still training, or killed) is exported only by naming a
    checkpoint; an out= holding another run's export, or no export at all, is replaced only with
    overwrite=true; a re-export of the same run replaces its own."""
    import shutil

    for name in ("a", "b"):
        train(std, tmp_path / name, max_steps=2, save_every=1)
    shutil.copytree(tmp_path / "a", tmp_path / "running")
    (tmp_path / "running" / "manifest.json").unlink()  # what a run still training looks like
    export = lambda run, out, **kw: Exporter(ExportConfig(run=str(run), out=str(out), **kw)).run()  # noqa: E731
    with pytest.raises(
        ContractError,
        match=r"running is still training, or stopped before its end .*last checkpoint is "
        r"step2\): to export that checkpoint anyway, name it: run=.*running/checkpoints/step2",
    ):
        export(tmp_path / "running", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    export(tmp_path / "running" / "checkpoints" / "step2", tmp_path / "x")
    export(tmp_path / "a", tmp_path / "ea")
    export(tmp_path / "a" / "checkpoints" / "step1", tmp_path / "ea")  # the same run: replaced
    with pytest.raises(
        ContractError, match=r"ea holds the export of another run \(checkpoint step1\) than .*/b/checkpoints/"
    ):
        export(tmp_path / "b", tmp_path / "ea")
    export(tmp_path / "b", tmp_path / "ea", overwrite=True)
    manifest = json.loads((tmp_path / "ea" / "manifest.json").read_text())  # the run by a hash, not its path
    assert manifest["run_sha256"] == run_sha256(tmp_path / "b" / "checkpoints" / "step2") != run_sha256(tmp_path / "a")
    assert manifest["checkpoint"] == "step2" and str(tmp_path) not in json.dumps(manifest)
    legacy = manifest | {"checkpoint": str(tmp_path / "b" / "checkpoints" / "step2")}  # as exports wrote it before
    del legacy["run_sha256"]
    (tmp_path / "ea" / "manifest.json").write_text(json.dumps(legacy))
    export(tmp_path / "b", tmp_path / "ea")  # still known as this run's export: replaced
    with pytest.raises(ContractError, match=r"another run"):
        export(tmp_path / "a", tmp_path / "ea")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    with pytest.raises(ContractError, match=r"notes exists and is not an export"):
        export(tmp_path / "a", tmp_path / "notes")
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


def test_every_train_option_is_fingerprinted_or_listed():
    """A new option joins the request unless core.fingerprint lists it, and every listed name exists."""
    from eagle3_train.core.cli import config_dict
    from eagle3_train.core.fingerprint import CONTINUATIONS, OUTSIDE_REQUEST, flatten, request_options

    options = flatten(config_dict(TrainConfig(data="d", out="o")))
    listed = {**OUTSIDE_REQUEST["train"], **CONTINUATIONS["train"]}
    for name in listed:
        assert any(o == name or o.startswith(f"{name}.") for o in options), f"{name} is no train option"
    request = request_options("train", config_dict(TrainConfig(data="d", out="o")))
    assert {"optim.lr", "objective.ttt_length", "model.lm_head_init", "deepspeed.zero_stage", "source"} <= set(request)
    assert not {"loop.epochs", "progress", "out", "logging.wandb"} & set(request)


def test_data_from_another_target_is_refused(std, tmp_path):
    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config

    cfg = tiny_config()
    cfg.rope_theta = 1234.0
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    other = tmp_path / "other"
    build_tiny_model(cfg).save_pretrained(other)
    build_tiny_tokenizer().save_pretrained(other)
    o = train_sections(ttt_length=2, max_tokens_per_batch=600)
    with pytest.raises(ContractError, match="(?s)was captured from tiny, not from target .*config_hash"):
        Trainer(TrainConfig(data=str(std), target=str(other), out=str(tmp_path / "x"), **o, progress=False))


def test_missing_vocab_map_and_nan_loss(std, tmp_path):
    import shutil

    from eagle3_train.core.formats import read_shard, write_shard

    data = tmp_path / "std"
    shutil.copytree(std, data)
    (data / "vocab_map.safetensors").rename(tmp_path / "vm")
    with pytest.raises(BadInputError, match="has no vocab map"):
        train(data, tmp_path / "a", max_steps=1)
    (tmp_path / "vm").rename(data / "vocab_map.safetensors")
    for shard in (data / "train").glob("*.safetensors"):
        t = read_shard(shard)
        t["aux_hidden"][:] = float("nan")
        write_shard(data / "train", shard.stem, t)
    with pytest.raises(Eagle3Error, match=r"non-finite loss at step 1 .*samples \[\d+"):
        train(data, tmp_path / "b", max_steps=2)


def test_a_non_finite_loss_stops_training_before_a_checkpoint_holds_it(std, tmp_path, monkeypatch):
    """The finiteness of each loss is read from the device only before a log, an evaluation or a
    checkpoint: a non-finite loss at step 3 is still reported as step 3, and training stops before
    the step-3 checkpoint, so the last checkpoint is the last good one."""
    from eagle3_train.training.trainer import Trainer

    real, calls = Trainer.losses, []

    def losses(self, batch):
        loss, stats = real(self, batch)
        calls.append(batch.sample_ids.tolist())
        return (loss * float("nan") if len(calls) == 3 else loss), stats

    monkeypatch.setattr(Trainer, "losses", losses)
    with pytest.raises(
        Eagle3Error,
        match=r"non-finite loss at step 3 \(epoch 0, micro-batch of samples (\[[^]]*\]).*"
        r"last good checkpoint: \S*step2$",
    ) as err:
        train(std, tmp_path / "r", save_every=1, log_every=100, max_steps=5)
    assert err.match(re.escape(str(calls[2][:8])))
    assert [p.name for p in sorted((tmp_path / "r" / "checkpoints").glob("step*"))] == ["step1", "step2"]


def test_corrupt_shard_is_refused_by_name(std, tmp_path):
    """64 bytes zeroed in the middle of a train shard (its tensors still parse): the sha256 recorded
    beside it no longer matches, and training stops naming the shard instead of training on it."""
    import shutil

    data = tmp_path / "std"
    shutil.copytree(std, data)
    shard = sorted((data / "train").glob("*.safetensors"))[-1]
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    assert any(raw[mid : mid + 64])  # the zeros really change the file
    raw[mid : mid + 64] = bytes(64)
    shard.write_bytes(bytes(raw))
    with pytest.raises(
        BadInputError, match=rf"^shard {shard} is corrupt: its sha256 differs from {shard.stem}.json"
    ) as e:
        train(data, tmp_path / "r", epochs=1)
    assert "\n" not in str(e.value)
    shard.write_bytes(bytes(raw[:-8]))  # truncated: the size already differs
    with pytest.raises(
        BadInputError, match=rf"^shard {shard} is corrupt: its size \({len(raw) - 8} bytes, recorded {len(raw)}\)"
    ):
        train(data, tmp_path / "t", epochs=1)


def test_cached_target_distribution_gives_the_same_training(std, tmp_path, monkeypatch):
    """runtime.cache_target_gb: the target lm_head runs once per sample, not once per epoch, and the
    run is the one without the cache (up to float rounding of per-sample vs batched matmuls)."""
    import eagle3_train.training.ttt as trainer_module  # where the TTT loss and the cache compute it
    from eagle3_train.core.formats import read_shard

    calls = []
    real = trainer_module.target_distribution
    monkeypatch.setattr(trainer_module, "target_distribution", lambda h, *a: calls.append(h.shape[0]) or real(h, *a))
    plain = train(std, tmp_path / "plain", epochs=3)
    plain_rows = sum(calls)
    calls.clear()
    cached = train(std, tmp_path / "cached", epochs=3, cache_target_gb=1.0)
    tokens = sum(read_shard(p)["input_ids"].numel() for p in std.glob("*/*.safetensors"))
    assert sum(calls) == tokens  # every sample of both splits exactly once
    assert plain_rows > 3 * tokens  # three epochs of padded batches, and the evaluations
    assert cached["eval_acc"] == pytest.approx(plain["eval_acc"], abs=0.02)
    a = load_file(str(tmp_path / "plain" / "checkpoints" / f"step{plain['step']}" / "draft.safetensors"))
    b = load_file(str(tmp_path / "cached" / "checkpoints" / f"step{cached['step']}" / "draft.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-3, rtol=1e-3)
    with pytest.raises(Eagle3Error, match="cache_target_gb=1e-06 is too small: .* needs"):
        train(std, tmp_path / "small", cache_target_gb=1e-6)


REAL_EVALUATE = Trainer.evaluate


def _scripted_taus(monkeypatch, taus):
    """Each evaluation runs for real (all its counting), but reports the next simulated tau of
    ``taus``: which checkpoint is best is then fixed, not a matter of training noise."""
    scripted = iter(taus)
    monkeypatch.setattr(Trainer, "evaluate", lambda self: REAL_EVALUATE(self) | {"eval_tau": next(scripted)})


def _ckpt_names(out):
    return sorted(p.name for p in (out / "checkpoints").glob("step*"))


def test_keep_best_exports_the_best_checkpoint(std, tmp_path, monkeypatch):
    """Evaluations every 2 of 12 steps peak at step 4: that checkpoint outlives keep_last=1,
    best.json names it, and eagle3-export of the run writes its weights, not the last ones."""
    _scripted_taus(monkeypatch, [1.5, 2.5, 1.8, 2.5, 1.2, 2.0])  # steps 2, 4, ..., 12 (a tie is no improvement)
    out = tmp_path / "r"
    final = train(std, out, max_steps=12, eval_every=2, keep_best=True, keep_last=1)
    assert final["step"] == 12 and final["checkpoint"].endswith("step12") and final["best_checkpoint"].endswith("step4")
    assert [m["eval_tau"] for m in metrics(out) if "eval_tau" in m] == [1.5, 2.5, 1.8, 2.5, 1.2, 2.0]
    assert _ckpt_names(out) == ["step12", "step4"]
    assert json.loads((out / "best.json").read_text()) == {"checkpoint": "step4", "step": 4, "eval_tau": 2.5}
    config = Exporter(ExportConfig(run=str(out), out=str(tmp_path / "export"), dtype="float32")).run()
    training = config["eagle3_train"]["training"]
    assert training["checkpoint"] == "step4" and training["is_best"] and training["eval"]["eval_tau"] == 2.5
    assert training["ttt_length"] == 3 and training["last_eval"]["step"] == 12
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    best = load_file(str(out / "checkpoints" / "step4" / "draft.safetensors"))
    last = load_file(str(out / "checkpoints" / "step12" / "draft.safetensors"))
    assert set(exported) == set(best)
    for k in exported:
        assert torch.equal(exported[k], best[k]), k
    assert not torch.equal(exported["fc.weight"], last["fc.weight"])
    # without keep_best the run keeps no record and export takes the last checkpoint
    _scripted_taus(monkeypatch, [1.5, 2.5, 1.0])
    plain = train(std, tmp_path / "plain", max_steps=6, eval_every=2, keep_last=1)
    assert "best_checkpoint" not in plain and not (tmp_path / "plain" / "best.json").exists()
    config = Exporter(ExportConfig(run=str(tmp_path / "plain"), out=str(tmp_path / "export2"))).run()
    assert config["eagle3_train"]["training"]["checkpoint"] == "step6"


def test_early_stop_on_a_plateau(std, tmp_path, monkeypatch):
    """Patience 2: the evaluations at steps 6 and 8 do not beat step 4's, so the run stops at
    step 8 (of 12) without another evaluation, and running it again does not train past the stop."""
    _scripted_taus(monkeypatch, [1.5, 2.5, 2.5, 2.4])
    out = tmp_path / "r"
    final = train(std, out, max_steps=12, eval_every=2, early_stop_patience=2, keep_best=True, keep_last=1)
    assert final["step"] == 8 and final["best_checkpoint"].endswith("step4")
    assert [m["step"] for m in metrics(out) if "eval_tau" in m] == [2, 4, 6, 8]
    assert max(m["step"] for m in metrics(out)) == 8
    assert _ckpt_names(out) == ["step4", "step8"]
    assert json.loads((out / "checkpoints" / "step8" / "state.json").read_text())["early_stopped"]
    again = train(std, out, max_steps=12, eval_every=2, early_stop_patience=2, keep_best=True, keep_last=1)
    assert again["step"] == 8 and again["best_checkpoint"] == final["best_checkpoint"]
    assert max(m["step"] for m in metrics(out)) == 8


def test_best_tracker_counts_evaluations_without_a_better_one():
    """Ties do not improve; patience 2 stops at the second evaluation in a row without a better tau;
    the record survives state.json, and keep_best=false keeps no best checkpoint."""
    best = BestTracker(keep_best=True, patience=2)
    assert [best.update(step, tau) for step, tau in [(2, 1.5), (4, 2.5), (6, 2.5), (8, 3.0), (10, 2.9), (12, 2.0)]] == [
        False,
        False,
        False,
        False,
        False,
        True,
    ]
    assert best.kept() == {"step": 8, "eval_tau": 3.0} and best.evals_since_best == 2
    again = BestTracker(keep_best=False, patience=2)
    again.restore(json.loads(json.dumps(best.state())), Path("/nonexistent"), is_main=False)
    assert (again.record, again.evals_since_best, again.kept()) == (best.record, 2, None)


# What SGLang 0.5.23 and vLLM 0.33.0 load into a one-layer LlamaForCausalLMEagle3 (docs/concepts/storage.md)
ENGINE_WEIGHT_NAMES = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
}


@pytest.fixture(scope="module")
def std_part(std):
    """The same dump with a draft vocab of 200 of the 320 tokens: it misses some target argmaxes."""
    return standardized(std.parent / "d", std.parent / "std_part", 200)


def test_lm_head_from_the_target_frozen_and_exported(std_part, tmp_path):
    """model.lm_head_init=target: lm_head starts as the target's rows of the draft vocab (row i =
    target id i + d2t[i]) and norm as the target's final norm; frozen, it is exported unchanged,
    under the names and config the engines load."""
    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

    target = build_tiny_model()
    with torch.no_grad():  # a final norm that is not all ones, so copying it shows
        target.model.norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    target.save_pretrained(tmp_path / "target")
    build_tiny_tokenizer().save_pretrained(tmp_path / "target")
    head = target.lm_head.weight.detach()
    options = ModelOptions(lm_head_init="target", freeze_lm_head=True)
    o = train_sections(ttt_length=3, lr=3e-3, max_tokens_per_batch=600, max_steps=4)
    trainer = Trainer(
        TrainConfig(
            data=str(std_part),
            target=str(tmp_path / "target"),
            out=str(tmp_path / "r"),
            **o,
            model=options,
            progress=False,
        )
    )
    d2t = trainer.model.d2t.cpu()
    rows = head[torch.arange(len(d2t)) + d2t]  # [V_draft, H] by the map the engines use
    assert len(d2t) == 200 and not torch.equal(d2t, torch.zeros_like(d2t))
    assert torch.equal(trainer.model.lm_head.weight.detach().cpu(), rows)
    assert torch.equal(trainer.model.norm.weight.detach().cpu(), target.model.norm.weight.detach())
    assert not trainer.model.lm_head.weight.requires_grad
    final = trainer.run()
    trainer.close()
    assert final["eval_vocab_coverage"] < 1.0 and final["eval_acc"][0] < final["eval_acc_in_vocab"][0]
    config = Exporter(ExportConfig(run=str(tmp_path / "r"), out=str(tmp_path / "export"), dtype="float32")).run()
    weights = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(weights) == ENGINE_WEIGHT_NAMES
    assert torch.equal(weights["lm_head.weight"], rows)  # frozen through 4 steps
    assert not torch.equal(weights["norm.weight"], target.model.norm.weight.detach())  # trained
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    assert config["eagle3_train"]["training"]["model"] == {
        "variant": "eagle3",
        "lm_head_init": "target",
        "freeze_lm_head": True,
        "aux_norm": False,  # each flag as the head computes it, not as an option left null
        "fc_norm": False,
        "norm_before_residual": False,
        "norm_output": False,
        "intermediate_size": 0,
    }


def test_aux_norm_is_exported_as_the_engines_input_norm(std, tmp_path, said):
    """model.aux_norm: the norm is trained (its weight moves) and exported as the norm both engines
    build when the config sets norm_before_fc (input_norm, one RMSNorm over the whole fc input): the
    engines' math on the exported files (the flag read from its config) drafts what the trained head
    does, eagle3-eval builds that head for either engine, eagle3-check passes it, and check refuses
    the flag without the trained norm (or its weight) and the norm without the flag (the engines
    would leave input_norm out)."""
    from eagle3_train.engines.rules import DRAFT_WEIGHTS
    from eagle3_train.model import DraftConfig, Eagle3Draft
    from eagle3_train.serving.check import CheckConfig, run_check
    from eagle3_train.serving.loading import load_draft
    from eagle3_train.targets import load_target
    from test_peer_drafts import our_chain, reference_chain

    assert DRAFT_WEIGHTS == ENGINE_WEIGHT_NAMES
    final = train(std, tmp_path / "r", max_steps=4, model=ModelOptions(aux_norm=True))
    ckpt = tmp_path / "r" / "checkpoints" / f"step{final['step']}"
    trained = load_file(str(ckpt / "draft.safetensors"))
    assert trained["aux_norm.weight"].shape == (192,) and not torch.equal(trained["aux_norm.weight"], torch.ones(192))
    config = Exporter(ExportConfig(run=str(tmp_path / "r"), out=str(tmp_path / "x"), dtype="float32")).run()
    exported = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert set(exported) == ENGINE_WEIGHT_NAMES | {"input_norm.weight"}
    assert config["norm_before_fc"] is True and config["eagle_config"]["norm_before_fc"] is True
    assert torch.equal(exported["input_norm.weight"], trained["aux_norm.weight"])
    assert config["eagle3_train"]["training"]["model"]["aux_norm"] is True

    target = load_target("tiny", cache_dir=None, dtype="float32")
    head = Eagle3Draft(DraftConfig(**json.loads((ckpt / "state.json").read_text())["draft_config"])).float()
    embed = target.model.get_input_embeddings().weight.detach().float()
    head.load_state_dict(trained | {"embed_tokens.weight": embed})  # (the checkpoint keeps no embeddings)
    g = torch.Generator().manual_seed(0)
    aux = 3 * torch.randn(9, 192, generator=g) + 1  # states far from unit RMS, so the norm matters
    ids = torch.randint(0, 320, (10,), generator=g)
    with torch.no_grad():
        flags = {"norm_before_fc": json.loads((tmp_path / "x" / "config.json").read_text())["norm_before_fc"]}
        want_tokens, want = reference_chain(tmp_path / "x", embed, aux, ids, 4, flags)
        got_tokens, got = our_chain(head, aux, ids, 4)
        _, unnormed = reference_chain(tmp_path / "x", embed, aux, ids, 4, {})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens and not torch.allclose(unnormed, want, atol=1e-2)
    for engine in ("sglang", "vllm"):
        loaded, _ = load_draft(tmp_path / "x", target, engine)
        assert loaded.config.aux_norm and torch.equal(loaded.aux_norm.weight, head.aux_norm.weight)
        with torch.no_grad():
            torch.testing.assert_close(our_chain(loaded.float(), aux, ids, 4)[1], want, rtol=1e-4, atol=1e-4)
    # exported for vLLM alone (no eagle_config): the top-level flag is the one read
    only = Exporter(
        ExportConfig(run=str(tmp_path / "r"), out=str(tmp_path / "v"), dtype="float32", engines=["vllm"])
    ).run()
    assert "eagle_config" not in only and only["norm_before_fc"] is True
    assert load_draft(tmp_path / "v", target, "vllm")[0].config.aux_norm

    assert run_check(CheckConfig(draft=str(tmp_path / "x"), target="tiny")) == 0
    assert "forward: one RMSNorm over fc's input (input_norm, norm_before_fc), as trained with model.aux_norm" in said()
    c = json.loads((tmp_path / "x" / "config.json").read_text())
    del c["norm_before_fc"], c["eagle_config"]["norm_before_fc"]
    (tmp_path / "x" / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(tmp_path / "x"), target="tiny")) == 1
    out = said()
    assert (
        "trained with model.aux_norm (its norm is input_norm.weight), but config.json sets norm_before_fc neither"
        in out
    )
    assert "not part of the EAGLE-3 draft" not in out and "1 problem(s)" in out
    # the other way round: the flag without the trained norm, or without its weight
    c["norm_before_fc"] = True
    c["eagle3_train"]["training"]["model"]["aux_norm"] = False
    (tmp_path / "x" / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(tmp_path / "x"), target="tiny")) == 1
    assert "config.json sets norm_before_fc but the head was not trained with model.aux_norm" in said()
    c["eagle3_train"]["training"]["model"]["aux_norm"] = True
    (tmp_path / "x" / "config.json").write_text(json.dumps(c))
    save_file(
        {k: v for k, v in exported.items() if k != "input_norm.weight"}, str(tmp_path / "x" / "model.safetensors")
    )
    assert run_check(CheckConfig(draft=str(tmp_path / "x"), target="tiny")) == 1
    assert "config.json sets norm_before_fc but the weights hold no input_norm" in said()


def test_wider_mlp_is_exported_and_loaded_back(std, tmp_path):
    """model.intermediate_size: the draft MLP gets that width, export writes it to config.json (what
    SGLang and vLLM size the MLP from) and eagle3-eval's loader rebuilds the same head from it."""
    from eagle3_train.serving.loading import load_draft
    from eagle3_train.targets import load_target

    with pytest.raises(ConfigError, match="intermediate_size must be >= 0"):
        ModelOptions(intermediate_size=-1)
    final = train(std, tmp_path / "r", max_steps=2, model=ModelOptions(intermediate_size=96))
    weights = load_file(str(tmp_path / "r" / "checkpoints" / f"step{final['step']}" / "draft.safetensors"))
    assert weights["midlayer.mlp.up_proj.weight"].shape == (96, 64)  # the tiny target's MLP is 128 wide
    config = Exporter(ExportConfig(run=str(tmp_path / "r"), out=str(tmp_path / "x"), dtype="float32")).run()
    assert config["intermediate_size"] == 96
    head, _ = load_draft(tmp_path / "x", load_target("tiny", cache_dir=None, dtype="float32"))
    exported = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert head.midlayer.mlp.down_proj.weight.shape == (64, 96)
    assert torch.equal(head.midlayer.mlp.down_proj.weight, exported["midlayer.mlp.down_proj.weight"])


def _tracked(std, out, logging_cfg, **opt):
    """A short run (every step logged and saved) with the tracker ``logging_cfg`` names."""
    o = train_sections(
        **(
            {"ttt_length": 2, "lr": 3e-3, "max_tokens_per_batch": 600, "log_every": 1, "max_steps": 2, "save_every": 1}
            | opt
        )
    )
    t = Trainer(TrainConfig(data=str(std), target="tiny", out=str(out), **o, progress=False, logging=logging_cfg))
    try:
        return t.run()
    finally:
        t.close()


def test_resume_continues_the_same_offline_wandb_run(std, tmp_path, monkeypatch):
    """A run continued by resume=auto logs into the wandb run it started (offline: wandb names its
    directory by the id), whose id the run directory keeps."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    _tracked(std, out, LoggingConfig(tracker="wandb"), max_steps=2)
    _tracked(std, out, LoggingConfig(tracker="wandb"), max_steps=3)  # continues from step 2
    run_id = json.loads((out / TRACKER_FILE).read_text())["wandb_run_id"]
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    # offline-run-<start time>-<id>; wandb adds -1 to the second where both started within the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", n) for n in runs)


def test_tensorboard_holds_the_logged_scalars(std, tmp_path):
    """logging=tensorboard: the events under <out>/tensorboard hold every scalar of metrics.jsonl,
    at its step, once; a continued run adds its steps to them (none lost, none repeated)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    _tracked(std, out, LoggingConfig(tracker="tensorboard"), max_steps=2, eval_every=1)
    _tracked(std, out, LoggingConfig(tracker="tensorboard"), max_steps=3, eval_every=1)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = metrics(out)
    for name in ("loss", "lr", "tau", "eval_loss", "eval_tau", "acc/0", "eval_acc/1"):
        key, _, j = name.partition("/")
        want = [(r["step"], r[key][int(j)] if j else r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in want], name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), name


def test_lm_head_trains_only_its_first_steps(std, tmp_path):
    """optim.lm_head_steps=2: lm_head moves in the first two optimizer steps and not after (its lr is 0),
    while the rest of the draft keeps training; without it, lm_head keeps moving."""
    ckpt = lambda d, s: load_file(str(d / "checkpoints" / f"step{s}" / "draft.safetensors"))  # noqa: E731
    for name, opt in (("frozen_after_2", {"lm_head_steps": 2}), ("plain", {})):
        train(std, tmp_path / name, save_every=1, keep_last=10, max_steps=4, warmup_steps=0, **opt)
    frozen = [ckpt(tmp_path / "frozen_after_2", s) for s in (1, 2, 3, 4)]
    plain = [ckpt(tmp_path / "plain", s) for s in (1, 2, 3, 4)]
    assert not torch.equal(frozen[0]["lm_head.weight"], frozen[1]["lm_head.weight"])  # step 2 still trains it
    assert torch.equal(frozen[1]["lm_head.weight"], frozen[3]["lm_head.weight"])  # steps 3 and 4 do not
    assert not torch.equal(frozen[1]["fc.weight"], frozen[3]["fc.weight"])
    assert not torch.equal(plain[1]["lm_head.weight"], plain[3]["lm_head.weight"])
    # until the freeze the two runs are one run (to float rounding: the optimizer steps two groups)
    torch.testing.assert_close(frozen[1]["lm_head.weight"], plain[1]["lm_head.weight"], atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match="optim.lm_head_steps .* model.freeze_lm_head never: choose one"):
        TrainConfig(
            data="d",
            out="o",
            **train_sections(lm_head_steps=2),
            model=ModelOptions(lm_head_init="target", freeze_lm_head=True),
        )


def test_wall_clock_budget_sizes_the_total_from_the_measured_rate():
    """The first window (start-up included) keeps the total; later windows are measured from its
    end; the total never exceeds what the epochs allow; a spent budget ends the run where it stands,
    in the first window too; earlier runs' seconds count."""
    b = WallClockBudget(seconds=100, planned=1000)
    assert b.total(10, 20.0, current=1000) == 1000  # compilation in this window: no rate yet
    assert b.total(20, 25.0, current=1000) == 20 + 150  # 2 steps/s since the first window's end, 75 s left
    assert b.total(30, 30.0, current=170) == 30 + 140
    assert b.total(31, 100.5, current=170) == 31  # spent
    capped = WallClockBudget(seconds=100, planned=50)
    assert capped.total(10, 20.0, current=50) == 50 and capped.total(20, 25.0, current=50) == 50  # 170 would fit
    assert WallClockBudget(seconds=10, planned=1000).total(5, 11.0, current=1000) == 5
    resumed = WallClockBudget(seconds=100, planned=1000, spent=90.0)
    assert resumed.total(10, 5.0, current=30) == 30 and resumed.total(12, 10.0, current=30) == 12
    with pytest.raises(ConfigError, match="loop.max_minutes must be > 0"):
        LoopConfig(max_minutes=0)


class _StepClock:
    """The trainer's clock: each optimizer step takes one second, each evaluation and save five
    (which the budget must not count)."""

    def __init__(self, monkeypatch):
        import eagle3_train.training.trainer as trainer_module

        self.now = 1000.0
        monkeypatch.setattr(trainer_module, "time", self)
        for name, seconds in (("train_step", 1.0), ("evaluate", 5.0), ("save", 5.0)):
            monkeypatch.setattr(Trainer, name, self.taking(getattr(Trainer, name), seconds))

    def taking(self, method, seconds):
        def timed(trainer, *args):
            self.now += seconds
            return method(trainer, *args)

        return timed

    def slowing(self, method, after, seconds):
        """``method`` (train_step as this clock times it, a second a call) taking ``seconds`` a call after
        its first ``after`` calls."""
        calls = []

        def timed(trainer, *args):
            calls.append(1)
            self.now += 0.0 if len(calls) <= after else seconds - 1.0
            return method(trainer, *args)

        return timed

    def time(self):
        return self.now


@pytest.mark.slow
def test_max_minutes_ends_the_run_and_its_schedule_when_the_budget_does(std, tmp_path, monkeypatch, said):
    """At one step a second, 30.5 seconds are 30 steps of the 240 the epochs allow: the run stops
    there with its lr schedule sized to end at that step, records 30 s of loop (not its final
    evaluation and save), trains nothing more when run again, and continues for the seconds added
    when the budget is raised, its schedule sized to the new end from its first step."""
    _StepClock(monkeypatch)
    out, opts = tmp_path / "r", {"epochs": 40, "schedule": "linear", "min_lr_ratio": 0.1}
    final = train(std, out, max_minutes=30.5 / 60, **opts)
    assert final["step"] == 30
    logged = [m for m in metrics(out) if "lr" in m]
    assert logged[-1]["step"] == 30 and [m["loop_s"] for m in logged[:3]] == [1.0, 2.0, 3.0]
    o = OptimConfig(**{k: v for k, v in opts.items() if k != "epochs"})
    # a record's lr is the next step's (the schedule at index s); sized at step 2, after the first window
    assert [m["lr"] for m in logged[2:]] == pytest.approx([3e-3 * lr_factor(s, 30, o) for s in range(3, 31)])
    assert logged[-1]["lr"] == pytest.approx(3e-3 * 0.1)
    assert "about 30 steps fit at the measured rate; the lr schedule now ends at step 30" in said()
    state = json.loads((out / "checkpoints" / "step30" / "state.json").read_text())
    assert state["loop_seconds"] == 30.0 and state["total_steps"] == 30
    assert train(std, out, max_minutes=30.5 / 60, **opts)["step"] == 30
    assert max(m["step"] for m in metrics(out)) == 30
    said()
    assert train(std, out, max_minutes=45.5 / 60, **opts)["step"] == 45
    assert "continues from step 30 for the minutes loop.max_minutes leaves (about 45 steps" in said()
    resumed = [m for m in metrics(out) if "lr" in m and m["step"] > 30]
    assert [m["lr"] for m in resumed] == pytest.approx([3e-3 * lr_factor(s, 45, o) for s in range(31, 46)])
    assert json.loads((out / "checkpoints" / "step45" / "state.json").read_text())["loop_seconds"] == 45.0


@pytest.mark.slow
def test_a_budget_is_sized_every_ten_steps_whatever_log_every_is(std, tmp_path, monkeypatch, said):
    """With a log line every 50 steps, a 30.5 s budget at one step a second still ends at step 30, its
    lr schedule sized at step 20 (after the first ten-step window) to end there; only the last step logs."""
    _StepClock(monkeypatch)
    out, opts = tmp_path / "r", {"epochs": 40, "schedule": "linear", "min_lr_ratio": 0.1, "log_every": 50}
    assert train(std, out, max_minutes=30.5 / 60, **opts)["step"] == 30
    assert [m["step"] for m in metrics(out) if "lr" in m] == [30]
    assert "about 30 steps fit at the measured rate; the lr schedule now ends at step 30" in said()
    assert json.loads((out / "checkpoints" / "step30" / "state.json").read_text())["total_steps"] == 30
    # sized at step 20 to end at 60 (60.5 s at a step a second), its steps then take 5 s: the budget is spent
    # at step 30, between log lines, and the steps since the last record are logged there
    clock, out = _StepClock(monkeypatch), tmp_path / "slower"
    monkeypatch.setattr(Trainer, "train_step", clock.slowing(Trainer.train_step, after=20, seconds=5.0))
    assert train(std, out, max_minutes=60.5 / 60, **opts)["step"] == 30
    logged = [m for m in metrics(out) if "lr" in m]
    assert [m["step"] for m in logged] == [30] and logged[0]["loop_s"] == 20 + 10 * 5.0
    assert "the budget is spent at step 30" in said()


def test_device_memory_reads_the_allocators_peaks_on_a_gpu_and_nothing_on_a_cpu(monkeypatch):
    """Each training record's memory fields: the CUDA allocator's peaks of this rank's device in GiB
    (asked of that device, not the current one), and no fields at all on a CPU."""
    from eagle3_train.training.metrics import device_memory

    asked = []

    def peak(value):
        return lambda device: asked.append(device) or value

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak(3 * 2**30 + 2**29))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", peak(5 * 2**30))
    assert device_memory(torch.device("cuda", 1)) == {"gpu_peak_alloc_gib": 3.5, "gpu_peak_reserved_gib": 5.0}
    assert asked == [torch.device("cuda", 1)] * 2
    assert device_memory(torch.device("cpu")) == {}


@pytest.mark.parametrize(
    "options, flags",
    [
        (ModelOptions(variant="eagle3.1"), {"fc_norm": True, "norm_output": True}),
        (ModelOptions(variant="eagle3.1", norm_output=False), {"fc_norm": True}),
        (ModelOptions(norm_before_residual=True), {"norm_before_residual": True}),
    ],
)
def test_head_variants_train_resume_and_export_what_the_engines_compute(std, tmp_path, options, flags):
    """model.variant and the four flags: the head trains with them (fc_norm's per-state norms move),
    a run resumed half-way ends with the weights of one trained straight through, the export's
    config sets exactly the flags the head was trained with (the engines' keys, top level) with the
    norms under the names the engines load, and the engines' math on the exported files (an
    independent reference, the flags read from its config) drafts what the trained head does."""
    from eagle3_train.model import DraftConfig, Eagle3Draft
    from eagle3_train.targets import load_target
    from test_peer_drafts import our_chain, reference_chain

    assert {f for f, on in options.head_flags().items() if on} == set(flags)
    straight = train(std, tmp_path / "a", max_steps=4, schedule="constant", model=options)
    train(std, tmp_path / "b", max_steps=2, schedule="constant", model=options)  # (the lr of a longer total)
    resumed = train(std, tmp_path / "b", max_steps=4, schedule="constant", model=options)
    assert straight["step"] == resumed["step"] == 4
    ckpt = tmp_path / "a" / "checkpoints" / "step4"
    trained = load_file(str(ckpt / "draft.safetensors"))
    again = load_file(str(tmp_path / "b" / "checkpoints" / "step4" / "draft.safetensors"))
    for name, tensor in trained.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6)
    norms = sorted(n for n in trained if n.startswith("fc_norm."))
    assert norms == (["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"] if flags.get("fc_norm") else [])
    assert all(not torch.equal(trained[n], torch.ones(64)) for n in norms)  # trained
    engines = ["vllm"] if flags.get("norm_before_residual") else ["sglang", "vllm"]  # SGLang ignores that flag
    config = Exporter(
        ExportConfig(run=str(tmp_path / "a"), out=str(tmp_path / "x"), dtype="float32", engines=engines)
    ).run()
    assert {k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output") if config.get(k)} == set(
        flags
    )
    exported = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert set(exported) == ENGINE_WEIGHT_NAMES | set(norms)

    target = load_target("tiny", cache_dir=None, dtype="float32")
    head = Eagle3Draft(DraftConfig(**json.loads((ckpt / "state.json").read_text())["draft_config"])).float()
    embed = target.model.get_input_embeddings().weight.detach().float()
    head.load_state_dict(trained | {"embed_tokens.weight": embed})
    g = torch.Generator().manual_seed(0)
    aux = 3 * torch.randn(9, 192, generator=g) + 1  # states far from unit RMS, so the norms matter
    ids = torch.randint(0, 320, (10,), generator=g)
    with torch.no_grad():
        read = {k: config[k] for k in ("fc_norm", "norm_before_residual", "norm_output") if k in config}
        want_tokens, want = reference_chain(tmp_path / "x", embed, aux, ids, 4, read)
        got_tokens, got = our_chain(head, aux, ids, 4)
        _, plain = reference_chain(tmp_path / "x", embed, aux, ids, 4, {})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens and not torch.allclose(plain, want, atol=1e-3)


def test_muon_at_zero3_steps_as_at_zero1(std, tmp_path):
    """optim.optimizer=muon at ZeRO 3 (DeepSpeed refuses Muon beside its reduce-scatter, so the trainer
    turns that off) trains to the weights the same run reaches at ZeRO 1."""
    muon = {"optimizer": "muon", "muon_lr": 0.02, "lr": 3e-3, "warmup_steps": 0, "head_chunk": 0, "max_steps": 3}
    train(std, tmp_path / "z1", zero_stage=1, **muon)
    train(std, tmp_path / "z3", zero_stage=3, **muon)
    want, got = (load_file(str(last_checkpoint(tmp_path / z) / "draft.safetensors")) for z in ("z1", "z3"))
    assert last_checkpoint(tmp_path / "z3").name == "step3" and set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)


def test_muon_trains_freezes_lm_head_on_time_and_resumes_to_the_same_weights(std, tmp_path, monkeypatch):
    """optim.optimizer=muon through the trainer: the loss falls; with optim.lm_head_steps=2 lm_head
    (AdamW's) moves in the first two steps only while fc (Muon's) keeps moving; the lr logged is
    optim.lr's; a run stopped after step 5 resumes from step 4 (Muon's momentum restored) to the
    weights of the run never stopped."""
    ckpt = lambda d, s: load_file(str(d / "checkpoints" / f"step{s}" / "draft.safetensors"))  # noqa: E731
    muon = {"optimizer": "muon", "muon_lr": 0.02, "lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}
    train(std, tmp_path / "head2", save_every=1, keep_last=10, max_steps=4, lm_head_steps=2, **muon)
    frozen = [ckpt(tmp_path / "head2", s) for s in (1, 2, 3, 4)]
    assert not torch.equal(frozen[0]["lm_head.weight"], frozen[1]["lm_head.weight"])
    assert torch.equal(frozen[1]["lm_head.weight"], frozen[3]["lm_head.weight"])
    assert not torch.equal(frozen[1]["fc.weight"], frozen[3]["fc.weight"])
    assert {r["lr"] for r in metrics(tmp_path / "head2") if "loss" in r} == {3e-3}

    whole = train(std, tmp_path / "whole", save_every=2, **muon)
    logged = [r["loss"] for r in metrics(tmp_path / "whole") if "loss" in r and "eval_acc" not in r]
    assert logged[-1] < logged[0]
    again = killed_after_step_5_and_resumed(std, tmp_path / "cut", monkeypatch, **muon)
    want = load_file(str(last_checkpoint(tmp_path / "whole") / "draft.safetensors"))
    assert last_checkpoint(tmp_path / "whole").name == f"step{whole['step']}"
    for k in want:
        torch.testing.assert_close(again[k], want[k], atol=1e-6, rtol=1e-6)


def test_the_optimizer_and_its_options_are_checked_by_name():
    with pytest.raises(ConfigError, match="optim.optimizer must be one of adamw, muon, got 'mun'"):
        OptimConfig(optimizer="mun")
    with pytest.raises(ConfigError, match="optim.muon_lr must be > 0"):
        OptimConfig(optimizer="muon", muon_lr=0)
    with pytest.raises(ConfigError, match=r"optim.muon_momentum must be in \[0, 1\)"):
        OptimConfig(optimizer="muon", muon_momentum=1.0)
    with pytest.raises(ConfigError, match="optim.optimizer=muon .* deepspeed.offload_optimizer .* choose one"):
        TrainConfig(data="d", out="o", **train_sections(optimizer="muon"),
                    deepspeed=DeepSpeedConfig(offload_optimizer=True))  # fmt: skip


def test_without_deepspeeds_overflow_check_no_checkpoint_keeps_non_finite_weights(std, tmp_path, monkeypatch):
    """deepspeed.check_grad_overflow=false: a step that leaves a weight non-finite (its loss was
    finite) stops the run at the next save, naming the step and the last good checkpoint; with the
    check on, the weights are not looked at (no wait)."""
    step = Trainer.train_step

    def poisoned(self, batches):
        out = step(self, batches)
        if self.step == 4:  # (after its loss: step 4's was finite, the save at 4 finds the weight)
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.requires_grad).view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    ds = DeepSpeedConfig(zero_stage=1, check_grad_overflow=False)
    o = train_sections(ttt_length=3, lr=3e-3, max_tokens_per_batch=600, log_every=100, epochs=2, save_every=2)
    t = Trainer(TrainConfig(data=str(std), target="tiny", out=str(tmp_path / "run"), **o, progress=False, deepspeed=ds))
    try:
        with pytest.raises(Eagle3Error, match=r"non-finite weights after step 4 .*last good checkpoint: .*step2"):
            t.run()
    finally:
        t.close()
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").glob("step*")) == ["step2"]
    looked = []
    monkeypatch.setattr(Trainer, "check_weights", lambda self: looked.append(self.step))
    monkeypatch.setattr(Trainer, "train_step", step)
    train(std, tmp_path / "checked", save_every=2)
    assert looked == []


def test_runtime_cudnn_attention_sets_torchs_choice_for_the_run_only(std, tmp_path, monkeypatch):
    """runtime.cudnn_attention (false by default): torch may not pick cuDNN's attention while the run
    trains, unless asked; its own setting is back once the run closes, and after a run that failed to
    start."""
    seen = []
    step = Trainer.train_step

    def looked(self, batches):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", looked)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert before  # torch's default
    train(std, tmp_path / "off", epochs=1)
    assert seen and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled()
    seen.clear()
    train(std, tmp_path / "on", cudnn_attention=True, epochs=1)
    assert seen and all(seen)
    with pytest.raises(Eagle3Error):  # a run that cannot start (no such data) leaves torch as it was
        Trainer(TrainConfig(data=str(tmp_path / "none"), target="tiny", out=str(tmp_path / "x"), progress=False))
    assert torch.backends.cuda.cudnn_sdp_enabled()
