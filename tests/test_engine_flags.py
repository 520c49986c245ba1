"""The draft's forward flags as each engine version computes them (eagle3_train/engines/heads.py):
a head built with each flag exports with the keys every engine version reads, reads back (as
eagle3-eval reads it) to the same forward, and eagle3-check refuses a flag a named version ignores.
Also: no engine-name comparison outside eagle3_train/engines/, check's d2t rule, and the engine
a draft's format defaults to."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_train.core.contract import CaptureSpec
from eagle3_train.core.errors import ContractError
from eagle3_train.engines import registry
from eagle3_train.engines.heads import FLAG_NAMES, Flags
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.serving.check import CheckConfig, ServingConfig, _check_vocab, run_check
from eagle3_train.serving.drafts import default_engine, read_draft_dir
from eagle3_train.serving.export import ExportConfig, Exporter, draft_config_from_json
from eagle3_train.targets import load_target
from eagle3_train.targets.tiny import tiny_config

PACKAGE = Path(__file__).parent.parent / "eagle3_train"
PEERS = Path(__file__).parent / "fixtures" / "peers"
AUX = [1, 2, 3]  # HF indices of the tiny target (N=4)


@pytest.fixture(scope="module")
def target():
    return load_target("tiny", cache_dir=None, dtype="float32")


def checkpoint(root: Path, target, **flags) -> tuple[Path, Eagle3Draft]:
    """A checkpoint directory (as training writes one) of a random head with ``flags``; its norms
    drawn away from 1 so that each matters."""
    dc = DraftConfig.from_target(tiny_config(), len(AUX), 200)
    for k, v in flags.items():
        setattr(dc, k, v)
    torch.manual_seed(0)
    head = Eagle3Draft(dc)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
        head.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        head.d2t.fill_(100)  # draft id i -> target id i + 100
        head.t2d.zero_()
        head.t2d[100:300] = True
    spec = CaptureSpec(tuple(AUX), 4, dc.target_hidden_size, dc.vocab_size, "float32", target.identity)
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True)
    weights = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed_tokens", "rotary"))}
    save_file(weights, str(ckpt / "draft.safetensors"))
    state = {
        "step": 1,
        "capture": spec.to_dict(),
        "draft_config": dc.to_dict(),
        "vocab_sha256": "0" * 64,
        "model": {"aux_norm": dc.aux_norm},
        "ttt_length": 3,
    }
    (ckpt / "state.json").write_text(json.dumps(state))
    return ckpt, head.eval()


def export(ckpt: Path, out: Path, engines: list[str]) -> dict:
    return Exporter(ExportConfig(run=str(ckpt), out=str(out), engines=engines, dtype="float32")).run()


def read_back(out: Path, target, engine: str) -> Eagle3Draft:
    """The head as eagle3-eval builds it from the export for ``engine`` (serving/drafts.py)."""
    dd = read_draft_dir(out)
    weights = dd.weights()
    dc = draft_config_from_json(dd.layer, weights["fc.weight"].shape[1])
    for k, v in vars(dd.flags(engine)).items():
        setattr(dc, k, v)
    draft = Eagle3Draft(dc)
    weights["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach()
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("rotary") for k in missing), (missing, unexpected)
    return draft.eval()


def chain(head: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The logits of a TTT unroll of ``k`` steps: [k, T, V_draft]."""
    with torch.no_grad():
        return torch.stack([head.logits(h)[0] for h in head.unroll(aux[None], ids[None], k)])


# the keys each flag is written under, and the engines whose every version computes it
EXPECT = {
    "aux_norm": (
        {"norm_before_fc": True, "eagle_config.norm_before_fc": True},
        ["sglang", "vllm"],
        "input_norm.weight",
    ),
    "fc_norm": ({"fc_norm": True}, ["sglang", "vllm"], "fc_norm.2.weight"),
    "norm_before_residual": ({"norm_before_residual": True}, ["vllm"], None),
    "norm_output": ({"norm_output": True}, ["sglang", "vllm"], None),
}


@pytest.mark.parametrize("flag", FLAG_NAMES)
def test_each_flag_exports_with_the_keys_each_engine_reads_and_reads_back_to_the_same_forward(flag, target, tmp_path):
    keys, engines, weight = EXPECT[flag]
    ckpt, head = checkpoint(tmp_path, target, **{flag: True})
    config = export(ckpt, tmp_path / "x", engines)
    for path, value in keys.items():
        node = config
        for key in path.split("."):
            node = node[key]
        assert node is value, path
    assert config["num_aux_hidden_states"] == 3  # what both engines size fc (and fc_norm) by first
    assert config["eagle3_train"]["training"]["model"][flag] is True  # check holds the engines to it
    names = read_draft_dir(tmp_path / "x").names
    if weight:  # under the engines' name; ours (aux_norm.weight) is not left beside it
        assert weight in names and "aux_norm.weight" not in names
    for engine in engines:
        for row in registry.ENGINES[engine].forwards:  # every version read computes this flag from the export
            assert row.flags(config) == Flags(**{flag: True}), row.name
    g = torch.Generator().manual_seed(1)
    aux = 3 * torch.randn(7, 3 * 64, generator=g) + 1  # states far from unit RMS, so fc's norms matter
    ids = torch.randint(0, 320, (8,), generator=g)
    want = chain(head, aux, ids, 3)
    for engine in engines:
        torch.testing.assert_close(chain(read_back(tmp_path / "x", target, engine), aux, ids, 3), want)
    plain = head.config.__class__(**(head.config.to_dict() | {flag: False}))
    unflagged = Eagle3Draft(plain)
    unflagged.load_state_dict(head.state_dict(), strict=False)
    assert not torch.allclose(chain(unflagged.eval(), aux, ids, 3), want, atol=1e-3)  # the flag matters
    assert run_check(CheckConfig(draft=str(tmp_path / "x"), target="tiny")) == 0


def test_export_refuses_a_flag_an_engine_version_ignores_and_check_names_version_and_key(target, tmp_path, said):
    ckpt, _ = checkpoint(tmp_path, target, norm_before_residual=True)
    with pytest.raises(ContractError) as e:
        export(ckpt, tmp_path / "both", ["sglang", "vllm"])
    text = str(e.value)
    assert "sglang 0.5.17 ignores norm_before_residual: it would serve this head with the raw residual" in text
    assert "sglang 0.5.23 ignores norm_before_residual" in text and "engines=['vllm']" in text
    assert not (tmp_path / "both").exists()
    export(ckpt, tmp_path / "v", ["vllm"])
    assert run_check(CheckConfig(draft=str(tmp_path / "v"), target="tiny")) == 0  # the engines it was exported for
    said()
    assert run_check(CheckConfig(draft=str(tmp_path / "v"), target="tiny", serving=ServingConfig(engine="sglang"))) == 1
    out = said()
    assert "sglang 0.5.17, 0.5.23 ignores norm_before_residual: it would serve this head with the raw residual" in out
    assert "LlamaDecoderLayer.forward" in out  # where it was read
    # a config that lost the flag's key: every version reading it would serve the head without it
    c = json.loads((tmp_path / "v" / "config.json").read_text())
    del c["norm_before_residual"]
    (tmp_path / "v" / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(tmp_path / "v"), target="tiny")) == 1
    out = said()
    assert "the head was trained with model.norm_before_residual, but config.json does not set" in out
    assert "vllm 0.26.0, 0.33.0 would serve it without" in out and "1 problem(s)" in out


def test_no_engine_name_comparison_outside_the_engines_package():
    """What differs between engines is asked of the engine object (eagle3_train/engines/)."""
    names = "|".join(registry.ENGINES)
    pattern = re.compile(
        rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)"""  # equality
        rf"""|\bin\s*[(\[{{][^)\]}}]*["']({names})["']"""  # membership in a literal
        rf"""|[(\[{{]\s*["']({names})["']\s*[,:]"""  # a literal keyed or listed by engine names
    )
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for path in PACKAGE.rglob("*.py")
        if "engines" not in path.relative_to(PACKAGE).parts
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    }
    # eval's sliding-window note: to ask registry.ENGINES[engine].honours_sliding_window() (its owner's change)
    assert found == set(), sorted(found)


def test_a_zero_d2t_is_the_trained_map_where_t2d_confirms_it():
    """speculators pads a draft vocab chosen from few distinct tokens with the lowest ids: a map of
    ids 0..255 (d2t all zeros) whose t2d marks exactly those is the trained one; a zero d2t with an
    empty t2d (its unset buffers) or none to confirm it is not."""
    d2t, t2d = torch.zeros(256, dtype=torch.int64), torch.zeros(320, dtype=torch.bool)
    assert "never filled" in _check_vocab({}, {"d2t": d2t, "t2d": t2d}, 320)[0].text
    t2d[:256] = True
    assert _check_vocab({}, {"d2t": d2t, "t2d": t2d}, 320) == []
    assert "almost surely not the trained map" in _check_vocab({}, {"d2t": d2t}, 320)[0].text
    t2d[300] = True  # marks an id d2t does not map to
    assert [f.text for f in _check_vocab({}, {"d2t": d2t, "t2d": t2d}, 320)] == [
        "d2t is all zeros: the draft vocab would be target ids 0..255, almost surely not the trained map",
        "t2d does not mark exactly the target ids d2t maps to",
    ]


def test_the_default_engine_follows_the_drafts_format(target, tmp_path):
    assert default_engine(read_draft_dir(PEERS / "speculators")) == "vllm"  # SGLang cannot load it
    assert default_engine(read_draft_dir(PEERS / "modelopt")) == "sglang"
    ckpt, _ = checkpoint(tmp_path, target)
    export(ckpt, tmp_path / "both", ["sglang", "vllm"])
    export(ckpt, tmp_path / "v", ["vllm"])
    assert default_engine(read_draft_dir(tmp_path / "both")) == "sglang"
    assert default_engine(read_draft_dir(tmp_path / "v")) == "vllm"  # the engines it was exported for


def test_engine_facts_are_asked_of_the_engine():
    vllm, sglang = registry.ENGINES["vllm"], registry.ENGINES["sglang"]
    assert [r.version for r in vllm.forwards] == ["0.26.0", "0.33.0"]
    assert [r.version for r in sglang.forwards] == ["0.5.17", "0.5.23"]
    assert sglang.forward().ignored() == ["norm_before_residual"] and vllm.forward().ignored() == []
    assert vllm.honours_sliding_window() and not sglang.honours_sliding_window()
    assert vllm.loads(speculators=True) and not sglang.loads(speculators=True)
    # speculators configs: vLLM copies the top-level flags, norm_before_residual on when absent
    assert vllm.draft_flags({}, speculators=True) == Flags(norm_before_residual=True)
    # SGLang's legacy use_aux_norm turns fc_norm on even beside fc_norm: false (`fc_norm or use_aux_norm`)
    assert sglang.draft_flags({"fc_norm": False, "use_aux_norm": True}).fc_norm
    assert not vllm.draft_flags({"fc_norm": False, "use_aux_norm": True}).fc_norm
    # eagle_config first, then the top level
    assert not vllm.draft_flags({"eagle_config": {"norm_before_fc": False}, "norm_before_fc": True}).aux_norm
    assert (vllm.capture.memory_flag, sglang.capture.memory_flag) == (
        "--gpu-memory-utilization",
        "--mem-fraction-static",
    )
    assert sglang.capture.final_server and not vllm.capture.final_server and vllm.capture.writes_files
    assert sglang.capture.oldest[0] == "0.5.23" and vllm.capture.oldest is None
