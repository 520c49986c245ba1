import time

import pytest
import torch

from eagle3_train.core.errors import BadInputError, Eagle3Error
from eagle3_train.targets import load_target, target_identity
from eagle3_train.targets.tiny import TINY_SPECIAL_TOKENS


def test_tiny_target_is_fast_deterministic_and_small():
    load_target("tiny", cache_dir=None)  # imports
    start = time.perf_counter()
    a = load_target("tiny", cache_dir=None)
    assert time.perf_counter() - start < 0.5
    b = load_target("tiny", cache_dir=None)
    assert a.hidden_size <= 64 and a.num_hidden_layers <= 4 and a.vocab_size <= 512
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name
    assert a.identity == b.identity
    tok = a.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS] == list(range(256, 264))
    text = "héllo wörld 🙂"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.chat_template


def test_identity_tracks_template_and_config():
    a = load_target("tiny", cache_dir=None, load_model=False)
    b = load_target("tiny", cache_dir=None, load_model=False, chat_template="{{ messages[0]['content'] }}")
    assert a.identity.config_hash == b.identity.config_hash
    assert a.identity.chat_template_hash != b.identity.chat_template_hash
    cfg = a.config
    cfg.num_hidden_layers = 3
    assert target_identity("tiny", cfg, a.tokenizer).config_hash != a.identity.config_hash


def test_local_directory_target(tmp_path):
    t = load_target("tiny", cache_dir=None)
    t.model.save_pretrained(tmp_path / "m")
    t.tokenizer.save_pretrained(tmp_path / "m")
    local = load_target(str(tmp_path / "m"), cache_dir=None)
    assert local.identity.config_hash == t.identity.config_hash
    assert local.identity.tokenizer_hash == t.identity.tokenizer_hash
    ids = torch.tensor([[1, 2, 3, 258]])
    torch.testing.assert_close(local.model(ids).logits, t.model(ids).logits)


def test_bad_targets(tmp_path, monkeypatch):
    with pytest.raises(BadInputError, match="no such GGUF file"):
        load_target(str(tmp_path / "x.gguf"), cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="without config.json"):
        load_target(str(tmp_path / "empty"), cache_dir=None)
    with pytest.raises(BadInputError, match="does not exist"):
        load_target("./missing/model", cache_dir=None)
    # a typo beside a local model (models/mymodl): refused at once, naming the near one, never
    # tried as a hub id; a hub id the hub does not give (offline) is one message, no traceback
    (tmp_path / "models" / "mymodel").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        BadInputError,
        match=r"target models/mymodl does not exist, and models/ is a local "
        r"directory: a typo\? \(did you mean models/mymodel\?\)",
    ):
        load_target("models/mymodl", cache_dir=None)
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when the hub library is imported: set it there too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        BadInputError,
        match=r"target nobody-here/no-such-model is no local directory, and the hub "
        r"did not give it",
    ):
        load_target("nobody-here/no-such-model", cache_dir=None)
    with pytest.raises(Eagle3Error, match="float32"):
        load_target("tiny", cache_dir=None, dtype="fp8")


@pytest.mark.slow
def test_embedded_target_converts_once_and_matches_gguf(tmp_path, monkeypatch):
    """The embedded SmolLM2 is converted into the cache once; the cached copy, read back from disk,
    computes what the model transformers loaded from the GGUF computes."""
    from transformers import AutoModelForCausalLM

    loaded = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def keep(*args, **kwargs):  # the GGUF-loaded model the conversion starts from, kept as the reference
        model = from_pretrained(*args, **kwargs)
        loaded.append((kwargs.get("gguf_file"), model))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", keep)
    t = load_target("embedded", cache_dir=tmp_path)
    assert t.local_dir.parent == tmp_path and t.num_hidden_layers == 30 and t.hidden_size == 576
    assert t.vocab_size == 49152 and "quantization_config" not in t.config.to_dict()
    start = time.perf_counter()
    again = load_target("embedded", cache_dir=tmp_path)
    assert time.perf_counter() - start < 10 and again.local_dir == t.local_dir
    assert again.identity == t.identity
    gguf = [m for name, m in loaded if name is not None]
    assert len(gguf) == 1  # converted once: the second load read the cached directory
    ids = torch.tensor([[1, 504, 3458, 282, 4077, 30]])
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, gguf[0](ids).logits)


def test_target_tensors_read_only_the_shards_that_hold_them(tmp_path, monkeypatch):
    """Norm and lm_head come from their own shards (by the index); a hub target downloads the
    json files, then only those shards."""
    import json

    import huggingface_hub

    from eagle3_train.targets import load_target_tensors
    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model()
    model.save_pretrained(tmp_path / "t", max_shard_size="100KB")
    build_tiny_tokenizer().save_pretrained(tmp_path / "t")
    weight_map = json.loads((tmp_path / "t" / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map["model.norm.weight"], weight_map["lm_head.weight"]}
    others = set(weight_map.values()) - needed
    assert others
    for name in others:  # never opened
        (tmp_path / "t" / name).write_bytes(b"not a safetensors file")
    _, tensors = load_target_tensors(str(tmp_path / "t"), ("norm", "head"), cache_dir=None)
    assert torch.equal(tensors["norm"], model.model.norm.weight) and torch.equal(tensors["head"], model.lm_head.weight)
    calls = []

    def snapshot(repo_id, allow_patterns):
        calls.append(list(allow_patterns))
        return str(tmp_path / "t")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    load_target_tensors("some-org/some-model", ("norm", "head"), cache_dir=None)
    assert calls == [["*.json"], sorted(needed)]


def test_concurrent_gguf_conversions_convert_once(tmp_path, monkeypatch):
    """Ranks of one launch loading a GGUF target at once: one converts, the others wait on the lock
    and load its finished directory; a half-written directory left behind is replaced, not loaded."""
    import threading

    from eagle3_train.targets import gguf as targets

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    calls = []

    def slow_convert(src, dest):  # stands in for the dequantisation: slow, then complete
        calls.append(src)
        time.sleep(0.3)
        dest.mkdir()
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(targets, "_convert", slow_convert)
    cache = tmp_path / "cache"
    results = []
    threads = [threading.Thread(target=lambda: results.append(targets.convert_gguf(gguf, cache))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1
    assert (results[0] / "config.json").is_file()
    (results[0] / "config.json").unlink()  # a partial directory: converted again, in its place
    (results[0] / "junk").write_text("x")
    assert targets.convert_gguf(gguf, cache) == results[0] and len(calls) == 2
    assert not (results[0] / "junk").exists()
