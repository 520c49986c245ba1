"""Online training (``source=online``): the tiny target in the loop trains exactly as offline
training on a dump of the same data, across ranks and a kill."""

import json

import pytest
import torch
from safetensors.torch import load_file

from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.core.errors import ConfigError, ContractError
from eagle3_train.core.faults import FAULT_ENV
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.training.config import TrainConfig
from eagle3_train.training.online import OnlineConfig, PreparedConfig
from test_standardize import make_dump
from test_trainer import _torchrun, metrics, standardized, train

VOCAB = 12  # fewer than the data's distinct tokens: the map is a real choice, some targets fall outside it
EVAL = 0.15  # what test_trainer.standardized holds out
ONLINE = PreparedConfig(aux_indices=[1, 2, 3], draft_vocab_size=VOCAB, eval_fraction=EVAL)
ONLINE_ARGS = [
    "source=online",
    "prepared.aux_indices=[1,2,3]",
    f"prepared.draft_vocab_size={VOCAB}",
    f"prepared.eval_fraction={EVAL}",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """48 conversations prepared for the tiny target, and a float32 dump of them standardized."""
    root = tmp_path_factory.mktemp("online")
    dump = make_dump(root, "d", n=48)
    return {"prep": root / "d-prep", "std": standardized(dump, root / "std", VOCAB)}


def last_weights(run):
    ckpt = sorted((run / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))[-1]
    return ckpt.name, load_file(str(ckpt / "draft.safetensors")), json.loads((ckpt / "state.json").read_text())


def assert_same_training(a, b, rel, atol):
    """Same metrics line by line (losses within ``rel``) and final weights within ``atol``."""
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] and len(ma) > 5
    for x, y in zip(ma, mb):
        for key in ("loss", "eval_loss"):
            if key in x:
                assert x[key] == pytest.approx(y[key], rel=rel), (x["step"], key)
        for key in ("acc", "eval_acc"):
            if key in x:
                assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key)
    (na, wa, _), (nb, wb, _) = last_weights(a), last_weights(b)
    assert na == nb and wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0)


def test_online_training_equals_offline_training_from_a_dump(data, tmp_path):
    train(data["std"], tmp_path / "off")
    train(data["prep"], tmp_path / "on", source="online", prepared=ONLINE)
    assert_same_training(tmp_path / "off", tmp_path / "on", rel=1e-5, atol=1e-5)
    # the same vocab map (byte for byte), capture spec and vocab hash in the checkpoint
    assert (tmp_path / "on" / "vocab_map.safetensors").read_bytes() == (
        data["std"] / "vocab_map.safetensors"
    ).read_bytes()
    (_, _, off), (_, _, on) = last_weights(tmp_path / "off"), last_weights(tmp_path / "on")
    assert on["capture"] == off["capture"] and on["vocab_sha256"] == off["vocab_sha256"]
    # export reads an online run as an offline one
    configs = [Exporter(ExportConfig(run=str(tmp_path / r), out=str(tmp_path / f"x-{r}"))).run() for r in ("off", "on")]
    assert configs[0]["eagle3_train"]["capture"] == configs[1]["eagle3_train"]["capture"]
    # the map alone, from the prepared data: eagle3-standardize only_vocab=true data=<prepared>
    manifest = Standardizer(
        StandardizeConfig(
            out=str(tmp_path / "vocab"),
            only_vocab=True,
            data=str(data["prep"]),
            draft_vocab_size=VOCAB,
            eval_fraction=EVAL,
            progress=False,
        )
    ).run()
    assert manifest["stage"] == "vocab" and manifest["split"] == {"seed": 0, "eval_fraction": EVAL}
    assert (tmp_path / "vocab" / "vocab_map.safetensors").read_bytes() == (
        tmp_path / "on" / "vocab_map.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_online_training_with_the_target_compiled_equals_offline_training(data, tmp_path):
    """``online.compile=true``: the target's decoder layers run compiled and the run trains as the
    offline one on a dump of the same data (the dump is the eager forward's)."""
    from eagle3_train.training.online import OnlineSource

    compiled = []
    real = OnlineSource.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        compiled.append([layer._compiled_call_impl is not None for layer in self.model.base_model.layers])

    train(data["std"], tmp_path / "off")
    torch._dynamo.reset()  # (compile afresh: earlier tests may have spent the layer forward's recompile limit)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OnlineSource, "__init__", spy)
        train(data["prep"], tmp_path / "on", source="online", prepared=ONLINE, online=OnlineConfig(compile=True))
    assert compiled and all(all(layers) and layers for layers in compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # (they ran as compiled graphs)
    assert_same_training(tmp_path / "off", tmp_path / "on", rel=1e-5, atol=1e-5)


def test_online_compile_names_the_option_where_the_target_has_no_layers_to_compile():
    from eagle3_train.core.capture import compile_layers

    class Flat(torch.nn.Module):
        base_model = torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError, match=r"online.compile=true: Linear keeps no decoder layers"):
        compile_layers(Flat(), "online.compile=true")


@pytest.mark.slow
def test_two_ranks_and_a_killed_run_train_as_one_uninterrupted_rank(data, tmp_path):
    """1 rank x grad_accum 2 (the reference) = 2 ranks (gloo) x grad_accum 1 = the same run killed
    after its step-4 checkpoint and resumed."""
    train(data["prep"], tmp_path / "one", source="online", prepared=ONLINE, grad_accum=2, save_every=2)
    two = _torchrun(data["prep"], tmp_path / "two", 2, [*ONLINE_ARGS, "loop.grad_accum=1", "checkpoint.save_every=2"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_training(tmp_path / "one", tmp_path / "two", rel=1e-4, atol=1e-4)
    killed = _torchrun(
        data["prep"],
        tmp_path / "cut",
        1,
        [*ONLINE_ARGS, "loop.grad_accum=2", "checkpoint.save_every=2"],
        {FAULT_ENV: "train.step:5"},
    )
    assert killed.returncode != 0 and last_weights(tmp_path / "cut")[0] == "step4", killed.stderr[-3000:]
    train(data["prep"], tmp_path / "cut", source="online", prepared=ONLINE, grad_accum=2, save_every=2)
    assert_same_training(tmp_path / "one", tmp_path / "cut", rel=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "aux, message",
    [
        ([1, 4], r"aux index 4 = N is the post-norm final state \(N=4 layers\)"),
        ([0, 9], r"aux index 9 is out of range for a target with N=4 layers"),
        ([3, 1], r"not ascending"),
    ],
)
def test_a_capture_the_target_cannot_provide_is_refused_before_training(data, tmp_path, aux, message):
    with pytest.raises(ContractError, match=message):
        train(data["prep"], tmp_path / "r", source="online", prepared=PreparedConfig(aux_indices=aux))
    assert not (tmp_path / "r").exists()


def test_each_source_refuses_the_other_sources_data_and_options(data, tmp_path):
    with pytest.raises(
        ContractError,
        match=r"holds the output of stage 'prepare', not of eagle3-standardize \(a prepared "
        r"dataset trains with source=online\)",
    ):
        train(data["prep"], tmp_path / "a")
    with pytest.raises(ContractError, match=r"expected the output of stage 'prepare', found stage 'standardize'"):
        train(data["std"], tmp_path / "b", source="online", prepared=ONLINE)
    with pytest.raises(ConfigError, match=r"^prepared\.\* options read a prepared dataset \(source=online or served\)"):
        TrainConfig(data=str(data["std"]), out=str(tmp_path / "c"), prepared=ONLINE)
    with pytest.raises(
        ConfigError, match=r"^online\.\* options set how the target runs in this process \(source=online\)$"
    ):
        TrainConfig(data=str(data["std"]), out=str(tmp_path / "c"), online=OnlineConfig(overlap=False))


def test_a_vocab_map_counted_over_another_split_is_refused(data, tmp_path):
    other = PreparedConfig(
        aux_indices=[1, 2, 3], vocab_map=str(data["std"] / "vocab_map.safetensors"), eval_fraction=0.3
    )
    with pytest.raises(
        ContractError,
        match=r'counted over the split \{"eval_fraction": 0.15, "seed": 0\}.*holds out '
        r'\{"eval_fraction": 0.3, "seed": 0\}',
    ):
        train(data["prep"], tmp_path / "r", source="online", prepared=other)


@pytest.mark.slow
def test_extra_prepared_directories_train_as_one_directory_of_them_all(data, tmp_path):
    """prepared.extra_data: the 48 conversations prepared as two directories (ids 0-19 and 20-47) train
    exactly as the one directory that holds them all; overlapping ids are refused, naming both."""
    from dataclasses import replace

    from eagle3_train.core.errors import BadInputError
    from test_standardize import prepare_tiny

    lines = (data["prep"].parent / "d.jsonl").read_text().splitlines()
    for name, part, offset in (("a", lines[:20], 0), ("b", lines[20:], 20), ("clash", lines[:3], 19)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(part) + "\n")
        prepare_tiny(tmp_path / f"{name}.jsonl", tmp_path / f"{name}-prep", offset)
    train(data["prep"], tmp_path / "one", source="online", prepared=ONLINE)
    two = replace(ONLINE, extra_data=[str(tmp_path / "b-prep")])
    train(tmp_path / "a-prep", tmp_path / "two", source="online", prepared=two)
    assert_same_training(tmp_path / "one", tmp_path / "two", rel=1e-6, atol=1e-6)
    assert (tmp_path / "two" / "vocab_map.safetensors").read_bytes() == (
        tmp_path / "one" / "vocab_map.safetensors"
    ).read_bytes()
    clash = replace(ONLINE, extra_data=[str(tmp_path / "clash-prep")])
    with pytest.raises(BadInputError, match=r"sample id 19 is in both .*a-prep and .*clash-prep"):
        train(tmp_path / "a-prep", tmp_path / "three", source="online", prepared=clash)
