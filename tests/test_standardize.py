"""eagle3-standardize on dumps of the tiny target: vocab map, aux concatenation, split, merge."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from data_prep.dump import CaptureConfig, DumpConfig, Dumper
from data_prep.standardize import StandardizeConfig, Standardizer, split_eval
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, IncompleteError
from eagle3_train.core.formats import iter_samples, read_shard
from eagle3_train.core.vocab import build_vocab_map, load_vocab_map

STORED = [0, 1, 2, 3]


def prepare_tiny(jsonl, out, offset=0):
    """eagle3-prepare of a conversations file for the tiny target, its sample ids from ``offset``."""
    from data_prep.prepare import PrepareConfig, Preparer

    Preparer(
        PrepareConfig(target="tiny", input=str(jsonl), out=str(out), sample_id_offset=offset, progress=False)
    ).run()


def make_dump(root, name, n=40, offset=0, seed=0, aux=(1, 2, 3), extra=(0,)):
    rng = random.Random(seed)
    words = ["cat", "dog", "the", "a", "sun", "x", "yy", "zzz"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q" * rng.randint(1, 30)},
                {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 25)))},
            ]
        }
        for _ in range(n)
    ]
    (root / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prepare_tiny(root / f"{name}.jsonl", root / f"{name}-prep", offset)
    Dumper(
        DumpConfig(
            target="tiny",
            data=str(root / f"{name}-prep"),
            out=str(root / name),
            dtype="float32",
            progress=False,
            max_tokens_per_batch=500,
            shard_size_mb=0.3,
            capture=CaptureConfig(aux_indices=list(aux), extra_indices=list(extra)),
        )
    ).run()
    return root / name


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    return {"a": make_dump(root, "a"), "b": make_dump(root, "b", n=25, offset=1000, seed=1), "root": root}


def standardize(dumps_, out, **kw):
    kw.setdefault("draft_vocab_size", 40)
    kw.setdefault("eval_fraction", 0.1)
    return Standardizer(StandardizeConfig(dumps=[str(d) for d in dumps_], out=str(out), progress=False, **kw)).run()


def samples_of(directory):
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        t = read_shard(shard)
        for sid, sl in iter_samples(t):
            assert sid not in out
            out[sid] = {k: v[sl] for k, v in t.items() if k not in ("cu_seqlens", "sample_ids")}
    return out


def test_aux_hidden_is_chosen_layers_ascending_and_split_is_whole_samples(dumps, tmp_path):
    manifest = standardize([dumps["a"]], tmp_path / "s", aux_indices=[0, 2])
    assert manifest["capture"]["aux_indices"] == [0, 2]
    dumped = samples_of(dumps["a"] / "shards")
    train, held = samples_of(tmp_path / "s" / "train"), samples_of(tmp_path / "s" / "eval")
    assert not set(train) & set(held) and sorted({**train, **held}) == sorted(dumped)
    assert len(held) == 4 == manifest["counts"]["eval_samples"]  # round(0.1 * 40)
    for sid, got in {**train, **held}.items():
        src = dumped[sid]
        torch.testing.assert_close(
            got["aux_hidden"], torch.cat([src["hidden.0"], src["hidden.2"]], dim=1), rtol=0, atol=0
        )
        assert torch.equal(got["last_hidden"], src["last_hidden"])
        assert torch.equal(got["input_ids"], src["input_ids"]) and torch.equal(got["loss_mask"], src["loss_mask"])


def test_vocab_map_is_top_tokens_of_training_split(dumps, tmp_path):
    from datasets import load_from_disk

    manifest = standardize([dumps["a"]], tmp_path / "s", draft_vocab_size=12)
    vocab, sha = load_vocab_map(tmp_path / "s" / "vocab_map.safetensors", 320)
    assert sha == manifest["vocab"]["sha256"]
    # independent count: prepared rows minus the held-out ids, loss-masked tokens only
    held = {int(s) for s in read_shard(next((tmp_path / "s" / "eval").glob("*.safetensors")))["sample_ids"]}
    held |= {int(s) for p in (tmp_path / "s" / "eval").glob("*.safetensors") for s in read_shard(p)["sample_ids"]}
    ds = load_from_disk(str(dumps["root"] / "a-prep" / "dataset"))
    counts = Counter()
    for row in ds:
        if row["sample_id"] not in held:
            counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    top = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:12])
    t = read_shard(tmp_path / "s" / "vocab_map.safetensors")
    assert (torch.arange(12) + t["d2t"]).tolist() == top
    assert t["t2d"].nonzero().squeeze(1).tolist() == top and t["t2d"].dtype == torch.bool
    assert t["token_counts"][top].tolist() == [counts[i] for i in top]
    assert manifest["vocab"]["coverage"] == pytest.approx(sum(counts[i] for i in top) / sum(counts.values()))


def test_too_few_distinct_tokens_fill_lowest_unused_ids(caplog):
    counts = torch.zeros(10, dtype=torch.int64)
    counts[7], counts[3], counts[5] = 5, 9, 5
    v = build_vocab_map(counts, 5)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "only 3 distinct tokens" in caplog.text
    assert v.draft_ids.tolist() == [0, 1, 3, 5, 7]
    assert build_vocab_map(counts, 2).draft_ids.tolist() == [3, 5]  # tie 5/7 -> lower id


def test_split_is_deterministic_and_per_sample():
    ids = np.arange(100, 300)
    a, b = split_eval(ids, 0.1, seed=0), split_eval(ids, 0.1, seed=0)
    assert np.array_equal(a, b) and len(a) == 20
    assert not np.array_equal(a, split_eval(ids, 0.1, seed=1))
    assert np.array_equal(split_eval(ids[::-1].copy(), 0.1, seed=0), a)  # order does not matter
    assert len(split_eval(ids, 0.0, 0)) == 0


def test_copies_of_a_conversation_are_held_out_or_kept_together():
    """eagle3-prepare repeat=: copy r of sample i has id i + r * 2**48; all copies share i's fate, and
    data without copies splits as before the rule knew copies (a hash of the id alone, the first k)."""
    from eagle3_train.core.split import _mix64, copy_id

    ids = np.arange(100, 300)
    seed_key = _mix64(np.array([0], dtype=np.uint64))[0]
    first_k = np.sort(ids[np.argsort(_mix64(ids.astype(np.uint64) ^ seed_key), kind="stable")[:20]])
    assert np.array_equal(split_eval(ids, 0.1, seed=0), first_k)  # the rule before copies, for plain ids
    copies = np.concatenate([copy_id(ids, r) for r in range(4)])  # 4 copies of each of 200 conversations
    held = split_eval(copies, 0.1, seed=0)
    assert len(held) % 4 == 0 and len(held) >= 80
    base = held & ((1 << 48) - 1)
    for i in np.unique(base):
        assert set(held[base == i].tolist()) == {int(copy_id(i, r)) for r in range(4)}  # all of its copies
    assert np.array_equal(np.unique(base), split_eval(ids, 0.1, seed=0))  # the same conversations as once


def test_merge_two_dumps_and_reuse_vocab_map(dumps, tmp_path):
    first = standardize([dumps["a"]], tmp_path / "one")
    merged = standardize(
        [dumps["a"], dumps["b"]], tmp_path / "two", vocab_map=str(tmp_path / "one" / "vocab_map.safetensors")
    )
    assert merged["counts"]["train_samples"] + merged["counts"]["eval_samples"] == 65
    assert merged["vocab"]["sha256"] == first["vocab"]["sha256"]
    assert len(merged["sources"]) == 2


def test_rerun_resume_and_only_vocab(dumps, tmp_path):
    first = standardize([dumps["a"]], tmp_path / "s")
    assert standardize([dumps["a"]], tmp_path / "s")["created_at"] == first["created_at"]
    with pytest.raises(ContractError, match="only_vocab=true"):
        standardize([dumps["a"]], tmp_path / "s", draft_vocab_size=8)
    rebuilt = Standardizer(
        StandardizeConfig(out=str(tmp_path / "s"), only_vocab=True, draft_vocab_size=8, progress=False)
    ).run()
    assert (
        rebuilt["vocab"]["draft_vocab_size"] == 8
        and load_vocab_map(tmp_path / "s" / "vocab_map.safetensors")[0].draft_vocab_size == 8
    )
    # an interrupted run: no manifest, one output shard lost its record
    (tmp_path / "s" / "manifest.json").unlink()
    next((tmp_path / "s" / "train").glob("*.json")).unlink()
    resumed = standardize([dumps["a"]], tmp_path / "s", draft_vocab_size=8)
    assert resumed["run"]["converted_now"] == 1
    assert resumed["counts"] == rebuilt["counts"]


def test_bad_input(dumps, tmp_path):
    with pytest.raises(IncompleteError, match="has no manifest.json"):
        standardize([tmp_path], tmp_path / "x")
    with pytest.raises(ContractError, match=r"layers \[3\] are not in dump .*holds HF indices \[0, 1, 2\]") as e:
        other = make_dump(tmp_path, "c", n=5, offset=5000, aux=(1, 2), extra=(0,))
        standardize([other], tmp_path / "x", aux_indices=[1, 3])
    assert "capture.extra_indices" in str(e.value)
    with pytest.raises(
        ContractError, match="cannot be merged; they differ in:\n  aux_indices: \\[1, 2\\] != \\[1, 2, 3\\]"
    ):
        standardize([dumps["a"], other], tmp_path / "x")
    with pytest.raises(ContractError, match=r"sample id \d+ is in .*dumps to merge must hold disjoint samples"):
        standardize([dumps["a"], dumps["a"]], tmp_path / "x")
    with pytest.raises(ConfigError, match="draft_vocab_size must be positive"):
        standardize([dumps["a"]], tmp_path / "x", draft_vocab_size=0)


def test_corrupt_shard_is_named(tmp_path):
    d = make_dump(tmp_path, "d", n=8)
    shard = sorted((d / "shards").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x55
    shard.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match=f"shard {shard} is corrupt"):
        standardize([d], tmp_path / "x")


def test_max_samples_keeps_the_lowest_ids_of_merged_dumps(dumps, tmp_path):
    manifest = standardize([dumps["b"], dumps["a"]], tmp_path / "s", max_samples=30)
    train, held = samples_of(tmp_path / "s" / "train"), samples_of(tmp_path / "s" / "eval")
    assert sorted({**train, **held}) == list(range(30))  # dump a holds ids 0..39, dump b 1000..1024
    assert len(held) == 3 == manifest["counts"]["eval_samples"]  # round(0.1 * 30)
    full = samples_of(dumps["a"] / "shards")
    for sid, got in train.items():
        assert torch.equal(got["input_ids"], full[sid]["input_ids"])
    with pytest.raises(ContractError, match="max_samples: 30 != 20"):
        standardize([dumps["b"], dumps["a"]], tmp_path / "s", max_samples=20)
    with pytest.raises(ConfigError, match="max_samples must be positive"):
        StandardizeConfig(dumps=["x"], out="y", max_samples=0)
