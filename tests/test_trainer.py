"""eagle3-train on standardized dumps of the tiny target."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.errors import BadInputError, ContractError, Eagle3Error
from eagle3_train.trainer import DeepSpeedConfig, OptimConfig, TrainConfig, Trainer, lr_factor
from test_standardize import make_dump


@pytest.fixture(scope="module")
def std(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_dump(root, "d", n=48)
    Standardizer(StandardizeConfig(dumps=[str(root / "d")], out=str(root / "std"), draft_vocab_size=320,
                                   eval_fraction=0.15, progress=False)).run()
    return root / "std"


def train(std, out, **opt):
    zero = opt.pop("zero_stage", 1)
    o = OptimConfig(**({"ttt_length": 3, "lr": 3e-3, "max_tokens_per_batch": 600, "log_every": 1, "epochs": 2} | opt))
    t = Trainer(TrainConfig(data=str(std), target="tiny", out=str(out), train=o, progress=False,
                            deepspeed=DeepSpeedConfig(zero_stage=zero)))
    try:
        return t.run()
    finally:
        t.close()


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_learns_the_target(std, tmp_path):
    final = train(std, tmp_path / "r", epochs=12)
    logged = [m for m in metrics(tmp_path / "r") if "loss" in m]
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert final["eval_acc"][0] > 0.3  # chance is 1/320
    assert final["eval_tau"] > 1.5
    ck = tmp_path / "r" / "checkpoints" / f"step{final['step']}"
    weights = load_file(str(ck / "draft.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["fc.weight"].shape == (64, 192)
    assert torch.equal(weights["d2t"], torch.zeros(320, dtype=torch.int64))  # full vocab: identity map


def test_lr_schedule():
    o = OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert [round(lr_factor(s, 10, o), 3) for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 0.1]
    assert lr_factor(6, 10, OptimConfig(schedule="linear")) == pytest.approx(0.4)


def _torchrun(std, out, nproc, extra=(), env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "eagle3_train.trainer",
           f"data={std}", "target=tiny", f"out={out}", "progress=false", "train.ttt_length=3", "train.lr=3e-3",
           "train.max_tokens_per_batch=600", "train.log_every=1", "train.epochs=2", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_match_one_rank_with_the_same_global_batch(std, tmp_path):
    one = _torchrun(std, tmp_path / "one", 1, ["train.grad_accum=2"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun(std, tmp_path / "two", 2, ["train.grad_accum=1"])
    assert two.returncode == 0, two.stderr[-3000:]
    a = [m for m in metrics(tmp_path / "one") if "loss" in m]
    b = [m for m in metrics(tmp_path / "two") if "loss" in m]
    assert len(a) == len(b) > 3
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-5)
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-6)
    wa = load_file(str(sorted((tmp_path / "one" / "checkpoints").glob("step*"))[-1] / "draft.safetensors"))
    wb = load_file(str(sorted((tmp_path / "two" / "checkpoints").glob("step*"))[-1] / "draft.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=1e-3)


def test_kill_and_resume_gives_the_same_weights(std, tmp_path):
    whole = _torchrun(std, tmp_path / "whole", 1, ["train.save_every=2"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _torchrun(std, tmp_path / "cut", 1, ["train.save_every=2"], {"EAGLE3_TRAIN_CRASH_AFTER_STEP": "4"})
    assert killed.returncode != 0
    resumed = _torchrun(std, tmp_path / "cut", 1, ["train.save_every=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    last = lambda d: sorted((d / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))[-1]  # noqa: E731
    assert last(tmp_path / "whole").name == last(tmp_path / "cut").name
    wa, wb = load_file(str(last(tmp_path / "whole") / "draft.safetensors")), load_file(str(last(tmp_path / "cut") / "draft.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-6)


def test_resume_refuses_another_vocab_map(std, tmp_path):
    import shutil

    data = tmp_path / "std"
    shutil.copytree(std, data)
    train(data, tmp_path / "r", max_steps=2)
    Standardizer(StandardizeConfig(out=str(data), only_vocab=True, draft_vocab_size=200, progress=False)).run()
    with pytest.raises(ContractError, match="was trained with vocab map .* vocab_map=<the old map>"):
        train(data, tmp_path / "r", max_steps=4)


def test_data_from_another_target_is_refused(std, tmp_path):
    from eagle3_train.targets import build_tiny_model, build_tiny_tokenizer, tiny_config

    cfg = tiny_config()
    cfg.rope_theta = 1234.0
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    other = tmp_path / "other"
    build_tiny_model(cfg).save_pretrained(other)
    build_tiny_tokenizer().save_pretrained(other)
    o = OptimConfig(ttt_length=2, max_tokens_per_batch=600)
    with pytest.raises(ContractError, match="(?s)was captured from tiny, not from target .*config_hash"):
        Trainer(TrainConfig(data=str(std), target=str(other), out=str(tmp_path / "x"), train=o, progress=False))


def test_missing_vocab_map_and_nan_loss(std, tmp_path):
    import shutil

    from eagle3_train.formats import read_shard, write_shard

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


def test_cached_target_distribution_gives_the_same_training(std, tmp_path, monkeypatch):
    """train.cache_target_gb: the target lm_head runs once per sample, not once per epoch, and the
    run is the one without the cache (up to float rounding of per-sample vs batched matmuls)."""
    import eagle3_train.trainer as trainer_module
    from eagle3_train.formats import read_shard

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
