"""storage=fp8 (eagle3_train/core/storage.py) through dump, standardize and training, and the compiled
dump forward, on the tiny target."""

import json
import math
import shutil

import pytest
import torch

from data_prep.dump import verify
from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.core.errors import ConfigError, ContractError
from eagle3_train.core.storage import FP8, FP8_MAX, decode, dequantize, quantize
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.targets.tiny import build_tiny_model
from eagle3_train.training.data import OfflineSource
from test_dump import dump, mixed_conversations, prepare_tiny, stored_samples
from test_standardize import samples_of
from test_trainer import metrics, train


def e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest round-trip error e4m3 allows per element of ``x`` [..., H] with per-row ``scale``
    [...]: half a unit in the last place of x/scale (3 mantissa bits; subnormal step 2^-9 below
    2^-6), times the scale."""
    y = (x / scale.unsqueeze(-1)).abs()
    exponent = torch.floor(torch.log2(y.clamp_min(2.0**-6)))  # subnormals share the lowest binade's step
    return 2.0 ** (exponent - 4) * scale.unsqueeze(-1)


def test_fp8_round_trip_is_within_e4m3_bound_of_each_tokens_scale():
    torch.manual_seed(0)
    t, h = 64, 96
    x = torch.randn(t, h) * torch.logspace(-6, 4, t)[:, None]  # tokens 10 orders of magnitude apart
    x[:, 5] *= 300  # an outlier channel
    x[3] = 0.0  # an all-zero token
    x[7, :10] = 1e-30  # far below the token's scale: subnormal or zero
    q, scale = quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (t, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], x.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    back = dequantize(q, scale, torch.float32)
    s = scale[:, 0]
    live = s > 0
    err = (back - x).abs()
    assert (err[live] <= e4m3_bound(x[live], s[live]) * (1 + 1e-6)).all()
    assert (err[live] <= 16 * s[live, None]).all()  # half an ulp at the top binade [256, 448]
    assert (err[live] <= 2.0**-4 * x[live].abs() + 2.0**-10 * s[live, None]).all()
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # maps to 448 exactly
    assert torch.equal(back[3], torch.zeros(h)) and s[3] == 0
    # several layers side by side: one scale per token and layer slice
    q3, s3 = quantize(torch.cat([x, 1000 * x, x / 7], dim=1), groups=3)
    assert s3.shape == (t, 3)
    torch.testing.assert_close(s3, torch.stack([s, 1000 * s, s / 7], 1), rtol=1e-6, atol=0)
    torch.testing.assert_close(dequantize(q3, s3, torch.float32)[:, :h], back, rtol=0, atol=0)
    # a non-finite token gets a non-finite scale (the dump drops such samples)
    x[9, 2] = math.inf
    assert not torch.isfinite(quantize(x)[1][9]).all()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The same prepared data dumped (float32) as it is and as fp8."""
    root = tmp_path_factory.mktemp("storage")
    prepared = prepare_tiny(root, mixed_conversations(40, seed=0, max_user=50, max_words=20))
    dump(prepared, root / "plain").run()
    dump(prepared, root / "fp8", storage="fp8").run()
    return {"prepared": prepared, "plain": root / "plain", "fp8": root / "fp8", "root": root}


def test_fp8_dump_stores_each_state_within_the_bound_resumes_and_verifies(dumps, tmp_path):
    plain, fp8 = stored_samples(dumps["plain"]), stored_samples(dumps["fp8"])
    assert sorted(plain) == sorted(fp8) == list(range(40))
    for sid, exact in plain.items():
        got = fp8[sid]
        for key in ("hidden.0", "hidden.1", "hidden.2", "hidden.3", "last_hidden"):
            assert got[key].dtype == FP8 and got[f"{key}.scale"].shape == (len(exact[key]), 1)
            scale = got[f"{key}.scale"][:, 0]
            torch.testing.assert_close(scale, exact[key].abs().amax(-1) / FP8_MAX)
            back = dequantize(got[key], got[f"{key}.scale"], torch.float32)
            assert ((back - exact[key]).abs() <= e4m3_bound(exact[key], scale) * 1.01 + 1e-12).all(), (sid, key)
        assert torch.equal(got["input_ids"], exact["input_ids"])
    manifest = json.loads((dumps["fp8"] / "manifest.json").read_text())
    assert manifest["capture"]["storage"] == "fp8" and "last_hidden.scale" in manifest["keys"]
    plain_manifest = json.loads((dumps["plain"] / "manifest.json").read_text())
    # 5 states of H=64: fp32 -> 1 byte + a 4-byte scale per token and state
    assert manifest["counts"]["bytes_per_token"] < 0.3 * plain_manifest["counts"]["bytes_per_token"]

    # a crash: no manifest, one shard without its record, a temp file; the same command resumes
    out = tmp_path / "fp8"
    shutil.copytree(dumps["fp8"], out)
    (out / "manifest.json").unlink()
    sorted((out / "shards").glob("*.json"))[0].unlink()
    (out / "shards" / ".junk.safetensors.tmp").write_bytes(b"partial")
    with pytest.raises(ContractError, match="capture.storage: 'fp8' != 'dtype'"):
        dump(dumps["prepared"], out).run()
    dump(dumps["prepared"], out, storage="fp8").run()
    resumed = stored_samples(out)
    for sid, got in fp8.items():
        for key, value in got.items():
            assert torch.equal(
                resumed[sid][key].view(torch.uint8) if value.dtype == FP8 else resumed[sid][key],
                value.view(torch.uint8) if value.dtype == FP8 else value,
            )
    assert verify(out) == []
    shard = sorted((out / "shards").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    problems = verify(out)
    assert len(problems) == 1 and problems[0].startswith(shard.stem) and "sha256" in problems[0]


def standardize(dumps_, out, **kw):
    return Standardizer(
        StandardizeConfig(
            dumps=[str(d) for d in dumps_], out=str(out), draft_vocab_size=320, eval_fraction=0.15, progress=False, **kw
        )
    ).run()


def test_merge_of_plain_and_fp8_dumps_is_refused_naming_both(dumps, tmp_path):
    with pytest.raises(ContractError) as e:
        standardize([dumps["plain"], dumps["fp8"]], tmp_path / "s")
    text = str(e.value)
    assert "storage: 'fp8' != 'dtype'" in text and str(dumps["plain"]) in text and str(dumps["fp8"]) in text
    with pytest.raises(ConfigError, match="storage must be one of dtype, fp8, got 'int8'"):
        StandardizeConfig(dumps=["x"], out="y", storage="int8")


def test_standardize_keeps_or_converts_and_fp8_data_trains_as_its_dequantized_copy(dumps, tmp_path):
    kept = standardize([dumps["fp8"]], tmp_path / "kept")
    assert kept["capture"]["storage"] == "fp8"
    assert kept["shards"]["train"][0]["tensors"]["aux_hidden.scale"][2] == 3  # [T, n_aux]
    read_back = standardize([dumps["fp8"]], tmp_path / "read_back", storage="dtype")
    quantized = standardize([dumps["plain"]], tmp_path / "quantized", storage="fp8")
    assert read_back["capture"]["storage"] == "dtype"
    assert quantized["capture"]["storage"] == "fp8"
    k, q, r = (samples_of(tmp_path / name / "train") for name in ("kept", "quantized", "read_back"))
    assert sorted(k) == sorted(q) == sorted(r)
    for sid in k:
        # the dump's quantization and standardize's are one function of the same float32 states
        for key in ("aux_hidden", "last_hidden"):
            assert torch.equal(k[sid][key].view(torch.uint8), q[sid][key].view(torch.uint8))
            assert torch.equal(k[sid][f"{key}.scale"], q[sid][f"{key}.scale"])
            assert torch.equal(decode(k[sid])[key], r[sid][key])

    # the host batch carries e4m3 and scales; the states are read back on the device
    source = OfflineSource(str(tmp_path / "kept"), "tiny", None, 600, torch.device("cpu"), torch.float32)
    host = source.train_split.batch(source.train_split.length.argsort()[:3])
    assert host.aux_hidden.dtype == FP8 and host.aux_scale.shape == (*host.aux_hidden.shape[:2], 3)
    device = host.to(torch.device("cpu"), torch.float32)
    assert device.aux_hidden.dtype == torch.float32 and device.aux_scale is None
    plain = OfflineSource(str(tmp_path / "read_back"), "tiny", None, 600, torch.device("cpu"), torch.float32)
    assert torch.equal(device.aux_hidden, plain.train_split.batch(source.train_split.length.argsort()[:3]).aux_hidden)

    a = train(tmp_path / "kept", tmp_path / "run_fp8", epochs=1)
    b = train(tmp_path / "read_back", tmp_path / "run_read_back", epochs=1)
    assert [m["loss"] for m in metrics(tmp_path / "run_fp8") if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "run_read_back") if "loss" in m
    ]
    assert a["eval_acc"] == b["eval_acc"] and a["step"] > 2
    config = Exporter(ExportConfig(run=str(tmp_path / "run_fp8"), out=str(tmp_path / "export"), dtype="float32")).run()
    assert config["eagle3_train"]["capture"]["storage"] == "fp8"  # what the draft learned from, for the record


@pytest.mark.slow
def test_compiled_forward_equals_plain_forward_of_each_sample(dumps, tmp_path):
    from datasets import load_from_disk

    with pytest.raises(ConfigError, match="compile=true compiles the target run here"):
        dump(dumps["prepared"], tmp_path / "x", compile=True, backend="vllm")
    compiled = dump(dumps["prepared"], tmp_path / "c", compile=True)
    compiled.run()
    assert all(layer._compiled_call_impl is not None for layer in compiled.backend.model().base_model.layers)
    got = stored_samples(tmp_path / "c")
    ds = load_from_disk(str(dumps["prepared"] / "dataset"))
    model = build_tiny_model()
    with torch.no_grad():
        for sid in range(len(ds)):
            ref = model(torch.tensor(ds[sid]["input_ids"])[None], output_hidden_states=True).hidden_states
            for k in range(4):
                torch.testing.assert_close(got[sid][f"hidden.{k}"], ref[k][0])  # float32's default tolerance
            torch.testing.assert_close(got[sid]["last_hidden"], ref[4][0])
