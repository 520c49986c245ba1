import json

import pytest

from eagle3_train.core.contract import (
    CaptureSpec,
    TargetIdentity,
    default_aux_indices,
    differences,
    read_manifest,
    validate_aux_indices,
    write_manifest,
)
from eagle3_train.core.errors import ContractError, IncompleteError

IDENT = TargetIdentity("meta-llama/Llama-3.1-8B", "llama", "c" * 64, "t" * 64, "h" * 64)


def spec(**kw):
    base = dict(
        aux_indices=(2, 16, 29),
        num_hidden_layers=32,
        hidden_size=4096,
        vocab_size=128256,
        dtype="bfloat16",
        target=IDENT,
    )
    return CaptureSpec(**(base | kw))


def test_default_aux_indices():
    assert default_aux_indices(32) == (2, 16, 29)
    assert default_aux_indices(30) == (2, 15, 27)
    assert default_aux_indices(61) == (2, 30, 58)
    with pytest.raises(ContractError, match="N=6"):
        default_aux_indices(6)  # [2, 3, 3]: not three distinct layers


@pytest.mark.parametrize(
    "indices, message",
    [
        ([2, 16, 32], "= N is the post-norm final state"),
        ([2, 16, 40], "out of range .*N=32"),
        ([-1, 2], "out of range"),
        ([2, 2, 16], "repeat \\[2\\]"),
        ([16, 2, 29], "not ascending.*\\[2, 16, 29\\]"),
        ([], "empty"),
        ([2.0, 16], "not an integer"),
    ],
)
def test_validate_aux_indices_refuses(indices, message):
    with pytest.raises(ContractError, match=message):
        validate_aux_indices(indices, 32)


def test_validate_accepts_embedding_and_last_prenorm_layer():
    assert validate_aux_indices([0, 31], 32) == (0, 31)


def test_capture_spec_validates_on_construction():
    with pytest.raises(ContractError, match="post-norm"):
        spec(aux_indices=(2, 16, 32))
    with pytest.raises(ContractError, match="dtype"):
        spec(dtype="fp8")


def test_capture_spec_roundtrip_through_json():
    s = spec()
    assert CaptureSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_differences_name_every_field():
    other_target = TargetIdentity("/elsewhere/llama", "llama", "d" * 64, "t" * 64, "x" * 64)
    diffs = differences(spec(), spec(aux_indices=(3, 16, 29), hidden_size=2048, target=other_target))
    fields = sorted(d.split(":")[0] for d in diffs)
    assert fields == ["aux_indices", "hidden_size", "target.chat_template_hash", "target.config_hash"]
    # the path only names the target; listed on request
    full = differences(spec(), spec(target=other_target), include_informative=True)
    assert any(d.startswith("target.path:") for d in full)


def test_manifest_write_is_atomic_and_read_checks_stage(tmp_path):
    write_manifest(tmp_path, "dump", {"capture": spec().to_dict()})
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp file left
    m = read_manifest(tmp_path, "dump")
    assert CaptureSpec.from_dict(m["capture"]) == spec()
    with pytest.raises(ContractError, match="expected the output of stage 'prepare'"):
        read_manifest(tmp_path, "prepare")


def test_missing_manifest_is_incomplete(tmp_path):
    with pytest.raises(IncompleteError, match="has no manifest.json"):
        read_manifest(tmp_path)


def test_a_directory_an_option_named_is_refused_in_the_syntax_typed(tmp_path):
    """``data=/typo`` is answered as the user wrote it, not as a bare path."""
    with pytest.raises(IncompleteError, match=rf"^data={tmp_path / 'typo'}: no such directory$"):
        read_manifest(tmp_path / "typo", "prepare", option="data")
    with pytest.raises(IncompleteError, match=rf"^dumps={tmp_path} has no manifest.json: the stage"):
        read_manifest(tmp_path, "dump", option="dumps")
