"""eagle3-dump on the tiny target: exact states, resume after kills, bad input, verify."""

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.dump import CaptureConfig, DumpConfig, Dumper, verify
from data_prep.dump.hf import plan_batches
from eagle3_train.core.errors import ContractError, Eagle3Error, IncompleteError
from eagle3_train.core.formats import iter_samples, read_shard
from eagle3_train.targets.tiny import build_tiny_model

AUX = [1, 2, 3]
EXTRA = [0]


def prepare_tiny(root: Path, rows: list[dict]) -> Path:
    """``rows`` (conversations) prepared for the tiny target under ``root/p``."""
    from data_prep.prepare import PrepareConfig, Preparer

    (root / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Preparer(PrepareConfig(target="tiny", input=str(root / "in.jsonl"), out=str(root / "p"), progress=False)).run()
    return root / "p"


def mixed_conversations(n: int, seed: int, max_user: int, max_words: int) -> list[dict]:
    """``n`` one-turn conversations of random lengths (a user line, a reply of short words)."""
    rng = random.Random(seed)
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * rng.randint(1, max_user)},
                {
                    "role": "assistant",
                    "content": " ".join("ab"[rng.randint(0, 1)] * 3 for _ in range(rng.randint(1, max_words))),
                },
            ]
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """40 conversations of mixed lengths (30 to 150 tokens), prepared for the tiny target."""
    rows = mixed_conversations(40, seed=0, max_user=50, max_words=20)
    rows[7]["messages"][0]["content"] = "Z marks this one"
    return prepare_tiny(tmp_path_factory.mktemp("prep"), rows)


def dump(prepared, out, **kw):
    kw.setdefault("capture", CaptureConfig(aux_indices=AUX, extra_indices=EXTRA))
    cfg = DumpConfig(
        target="tiny",
        data=str(prepared),
        out=str(out),
        dtype="float32",
        progress=False,
        max_tokens_per_batch=kw.pop("max_tokens_per_batch", 600),
        shard_size_mb=kw.pop("shard_size_mb", 1),
        **kw,
    )
    return Dumper(cfg)


def stored_samples(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Every stored sample of a dump, by sample id (fails if one is stored twice)."""
    samples = {}
    for shard in sorted((out / "shards").glob("*.safetensors")):
        t = read_shard(shard)
        for sid, sl in iter_samples(t):
            assert sid not in samples, f"sample {sid} stored twice"
            samples[sid] = {k: v[sl] for k, v in t.items() if k not in ("cu_seqlens", "sample_ids")}
    return samples


def test_plan_batches_respects_budget_and_covers_all():
    lengths = np.array([5, 100, 30, 30, 7, 64, 1])
    batches = plan_batches(np.arange(7), lengths, max_tokens=120, max_batch=3)
    assert sorted(s for b in batches for s in b.rows) == list(range(7))
    assert all(b.padded_tokens <= 120 or len(b.rows) == 1 for b in batches)
    assert all(len(b.rows) <= 3 for b in batches)
    assert batches[0].rows == [1]  # longest first


def test_states_equal_plain_forward_of_each_sample_alone(prepared, tmp_path):
    from datasets import load_from_disk

    manifest = dump(prepared, tmp_path / "d").run()
    assert manifest["capture"]["aux_indices"] == AUX and manifest["stored_indices"] == [0, 1, 2, 3]
    assert (
        max(len(s["sample_ids"]) for s in [read_shard(p) for p in (tmp_path / "d" / "shards").glob("*.safetensors")])
        > 1
    )
    ds = load_from_disk(str(prepared / "dataset"))
    samples = stored_samples(tmp_path / "d")
    assert sorted(samples) == list(range(len(ds)))
    model = build_tiny_model()
    with torch.no_grad():
        for sid, got in samples.items():
            ids = torch.tensor(ds[sid]["input_ids"])
            assert torch.equal(got["input_ids"], ids.int())
            assert torch.equal(got["loss_mask"], torch.tensor(ds[sid]["loss_mask"], dtype=torch.uint8))
            ref = model(ids[None], output_hidden_states=True).hidden_states
            for k in [0, 1, 2, 3]:
                torch.testing.assert_close(got[f"hidden.{k}"], ref[k][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(got["last_hidden"], ref[4][0], atol=1e-5, rtol=0)
    assert manifest["counts"]["tokens"] == sum(ds["num_tokens"])
    assert manifest["counts"]["bytes_per_token"] > (4 + 1) * 64 * 4  # 5 states of H=64 fp32


def test_rerun_of_finished_dump_does_nothing_and_other_capture_is_refused(prepared, tmp_path):
    first = dump(prepared, tmp_path / "d").run()
    again = dump(prepared, tmp_path / "d").run()
    assert again["created_at"] == first["created_at"]
    with pytest.raises(ContractError, match=r"capture.aux_indices: \[1, 2, 3\] != \[1, 3\]"):
        dump(prepared, tmp_path / "d", capture=CaptureConfig(aux_indices=[1, 3])).run()


def test_partial_dump_resumes_and_refuses_other_capture(prepared, tmp_path):
    out = tmp_path / "d"
    dump(prepared, out).run()
    full = stored_samples(out)
    # a crash: no manifest, one shard lost its record, a temp file half written
    (out / "manifest.json").unlink()
    records = sorted((out / "shards").glob("*.json"))
    records[0].unlink()
    (out / "shards" / ".junk.safetensors.tmp").write_bytes(b"partial")
    with pytest.raises(ContractError, match="holds an unfinished dump made otherwise"):
        dump(prepared, out, capture=CaptureConfig(aux_indices=[2, 3])).run()
    manifest = dump(prepared, out).run()
    assert not list((out / "shards").glob(".*"))
    resumed = stored_samples(out)
    assert sorted(resumed) == sorted(full)
    for sid in full:
        for k, v in full[sid].items():
            torch.testing.assert_close(resumed[sid][k], v, atol=1e-5, rtol=0)
    assert len(manifest["shards"]) == len(records)


def test_nonfinite_sample_is_dropped_and_counted(prepared, tmp_path):
    d = dump(prepared, tmp_path / "d")
    z = d.target.tokenizer.convert_tokens_to_ids("Z")

    def poison(module, inputs, output):  # NaN in every sample containing the token 'Z'
        output[(inputs[0] == z).any(dim=1)] = float("nan")

    d.backend.model().get_input_embeddings().register_forward_hook(poison)
    manifest = d.run()
    assert manifest["nonfinite_sample_ids"] == [7]
    assert manifest["counts"]["nonfinite_samples"] == 1
    assert 7 not in stored_samples(tmp_path / "d") and len(stored_samples(tmp_path / "d")) == 39


def test_out_of_disk_leaves_nothing_partial_and_resumes(prepared, tmp_path, monkeypatch):
    import eagle3_train.core.formats as formats

    real = formats._serialize
    calls = {"n": 0}

    def full_disk(path, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            path.write_bytes(b"half a shard")  # the disk filled up mid-write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors)

    monkeypatch.setattr(formats, "_serialize", full_disk)
    with pytest.raises(Eagle3Error, match="out of disk space writing .*run the same command again"):
        dump(prepared, tmp_path / "d", writer_threads=1).run()
    shards = sorted(p.name for p in (tmp_path / "d" / "shards").iterdir())
    assert all(Path(s).suffix in (".json", ".safetensors") for s in shards)
    assert (
        len([s for s in shards if s.endswith(".json")]) == len([s for s in shards if s.endswith(".safetensors")]) == 1
    )
    monkeypatch.setattr(formats, "_serialize", real)
    manifest = dump(prepared, tmp_path / "d").run()
    assert manifest["counts"]["samples"] == 40


def test_verify_names_the_corrupt_shard(prepared, tmp_path):
    dump(prepared, tmp_path / "d").run()
    assert verify(tmp_path / "d") == []
    shard = sorted((tmp_path / "d" / "shards").glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify(tmp_path / "d")
    assert len(problems) == 1 and problems[0].startswith(shard.stem) and "sha256" in problems[0]


def test_bad_input(prepared, tmp_path):
    with pytest.raises(ContractError, match="aux index 4 = N is the post-norm final state \\(N=4"):
        dump(prepared, tmp_path / "a", capture=CaptureConfig(aux_indices=[1, 4]))
    with pytest.raises(ContractError, match="aux index 9 is out of range for a target with N=4"):
        dump(prepared, tmp_path / "a", capture=CaptureConfig(aux_indices=[1, 2], extra_indices=[9]))
    with pytest.raises(IncompleteError, match="has no manifest.json"):
        dump(tmp_path, tmp_path / "a")
    with pytest.raises(ContractError, match="N=4"):  # the default [2, N//2, N-3] needs more layers
        dump(prepared, tmp_path / "a", capture=CaptureConfig())


def _torchrun(prepared, out, nproc, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "data_prep.dump",
        "target=tiny",
        f"data={prepared}",
        f"out={out}",
        "dtype=float32",
        "progress=false",
        f"capture.aux_indices={AUX}".replace(" ", ""),
        f"capture.extra_indices={EXTRA}",
        "max_tokens_per_batch=300",
        "shard_size_mb=0.1",
        "max_batch_size=4",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_torchrun_two_ranks_killed_and_resumed_equals_one_process(prepared, tmp_path):
    one = dump(prepared, tmp_path / "one", max_tokens_per_batch=300, max_batch_size=4)
    one.run()
    # the first rank to rename its second shard dies before that shard's record; torchrun then kills
    # the other wherever it is. (Its writer threads write shards concurrently, so the first shard's
    # record may not be there either: what is sure is two renamed shards.)
    crashed = _torchrun(prepared, tmp_path / "two", 2, {"EAGLE3_FAULT_AT": "shard:2"})
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    assert not (tmp_path / "two" / "manifest.json").exists()
    partial = list((tmp_path / "two" / "shards").glob("*.safetensors"))
    assert len(partial) >= 2, crashed.stderr[-2000:]
    resumed = _torchrun(prepared, tmp_path / "two", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # it resumes from the recorded shards, or (no record was written before the kill) says it removed
    # the unrecorded ones and starts over: either way the result below equals one process's
    assert "resuming:" in resumed.stdout or "unfinished files of an interrupted run" in resumed.stdout, resumed.stdout
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["run"]["world_size"] == 2
    a, b = stored_samples(tmp_path / "one"), stored_samples(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(40))
    for sid in a:
        for k in a[sid]:
            torch.testing.assert_close(b[sid][k], a[sid][k], atol=1e-5, rtol=0)


def test_tensor_parallel_group_below_the_world_needs_a_transformers_that_takes_the_mesh(monkeypatch):
    """tp_size=2 on 4 ranks (data parallel 2): a transformers whose from_pretrained builds its own
    mesh over every rank would split each copy 4 ways; it is refused there, naming both sizes."""
    import inspect
    from types import SimpleNamespace

    import transformers

    from eagle3_train.core.errors import ConfigError
    from eagle3_train.targets import tensor_parallel_kwargs

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    mesh = SimpleNamespace(size=lambda: 2)
    prepare = getattr(transformers.PreTrainedModel, "prepare_distribute_model", None)
    if prepare is not None and "device_mesh" not in inspect.signature(prepare).parameters:
        with pytest.raises(ConfigError, match=r"^tp_size=2 with 4 ranks: .* use tp_size=4"):
            tensor_parallel_kwargs(mesh)
    else:
        assert tensor_parallel_kwargs(mesh)["device_mesh"] is mesh


@pytest.mark.slow
def test_tensor_parallel_dump_equals_single_process(prepared, tmp_path):
    """tp_size=2 under torchrun (gloo): transformers' own tensor-parallel plan, same states."""
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    model_dir = tmp_path / "tiny_hf"
    build_tiny_model().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    dump(prepared, tmp_path / "one").run()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "data_prep.dump",
        f"target={model_dir}",
        f"data={prepared}",
        f"out={tmp_path / 'tp'}",
        "dtype=float32",
        "progress=false",
        f"capture.aux_indices={AUX}".replace(" ", ""),
        f"capture.extra_indices={EXTRA}",
        "tp_size=2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "tp" / "manifest.json").read_text())
    assert manifest["run"]["tp_size"] == 2 and manifest["run"]["tokens_this_run"] == manifest["counts"]["tokens"]
    a, b = stored_samples(tmp_path / "one"), stored_samples(tmp_path / "tp")
    assert sorted(a) == sorted(b)
    for sid in a:
        for k in a[sid]:
            torch.testing.assert_close(b[sid][k], a[sid][k], atol=1e-5, rtol=0)


def test_a_capture_no_engine_serves_is_warned_before_dumping(prepared, tmp_path, caplog):
    """HF index 0 (the embeddings) reaches no served draft (SGLang cannot name it, vLLM's id 0
    arrives overwritten): the dump says so when it starts; an ordinary capture says nothing."""
    dump(prepared, tmp_path / "ok")
    assert "no serving engine" not in caplog.text
    dump(prepared, tmp_path / "embed", capture=CaptureConfig(aux_indices=[0, 2, 3]))
    (out,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "warning: no serving engine can feed a draft the capture [0, 2, 3]" in out
    assert "vLLM's id 0 arrives overwritten" in out and "its id would be -1" in out
