"""Shared fixtures: the tiny target, chat templates, and helpers to write inputs and run prepare."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, as torchrun runs have (OMP_NUM_THREADS=1): the same
    arithmetic in and out of process, no spinning pool on shared cores, and none that a fork loses
    (a forked child using more threads hangs). Modules take it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def said(caplog):
    """``said()``: the text the code under test logged (this package's loggers, INFO and above)
    since the last call, one record a line."""
    for name in ("eagle3_train", "data_prep"):
        caplog.set_level(logging.INFO, logger=name)

    def read() -> str:
        text = "\n".join(r.getMessage() for r in caplog.records)
        caplog.clear()
        return text

    return read


# Three template families the loss mask must be right for. Literal special tokens are those of the
# tiny tokenizer (eagle3_train.targets.TINY_SPECIAL_TOKENS).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# SmolLM2's template: ChatML that injects a default system prompt when none is given.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-2 style: the system prompt folds into the first user turn; a space separates the reply
# from its end-of-turn token; roles must alternate.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for message in msgs %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (sys if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' <|end_of_text|>' }}{% endif %}"
    "{% endfor %}"
)


@pytest.fixture
def write_jsonl(tmp_path: Path):
    """Write rows (dicts, or raw strings for broken lines) to a JSONL file; return its path."""

    def write(rows: list[Any], name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        with path.open("w") as f:
            for row in rows:
                f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
        return path

    return write


@pytest.fixture
def prepare(tmp_path: Path):
    """Run the prepare stage in process; return the manifest and the loaded dataset."""
    from datasets import load_from_disk

    from data_prep.prepare import PrepareConfig, Preparer

    def run(input: Path | str, out: str = "prepared", **options: Any):
        cfg = PrepareConfig(
            target=options.pop("target", "tiny"), input=str(input), out=str(tmp_path / out), progress=False, **options
        )
        manifest = Preparer(cfg).run()
        return manifest, load_from_disk(str(tmp_path / out / "dataset"))

    return run


PIPELINE_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "seven",
    "tiger",
    "music",
    "paper",
    "green",
    "window",
    "quick",
    "silver",
]


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    """(Session-wide: export/eval, reports and served acceptance share it.) A tiny target whose layers differ (init std 0.1) and which never emits special tokens but
    its end-of-turn (so regenerated text re-tokenises to the target's own trajectory)."""
    import random

    import torch

    from data_prep.dump import CaptureConfig, DumpConfig, Dumper
    from data_prep.prepare import PrepareConfig, Preparer
    from data_prep.regenerate import RegenConfig
    from data_prep.standardize import StandardizeConfig, Standardizer
    from eagle3_train.serving.export import ExportConfig, Exporter
    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer, tiny_config
    from eagle3_train.training.config import TrainConfig
    from eagle3_train.training.trainer import Trainer
    from train_options import train_sections

    root = tmp_path_factory.mktemp("e2e")
    cfg = tiny_config()
    cfg.initializer_range = 0.1
    model = build_tiny_model(cfg)
    with torch.no_grad():
        model.lm_head.weight[256:259] = 0  # specials other than <|im_end|> (259)
        model.lm_head.weight[260:] = 0
    model.save_pretrained(root / "target")
    build_tiny_tokenizer().save_pretrained(root / "target")
    target = str(root / "target")
    rng = random.Random(0)
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(PIPELINE_WORDS) for _ in range(rng.randint(2, 8)))}
            ]
        }
        for _ in range(80)
    ]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Preparer(
        PrepareConfig(
            target=target,
            input=str(root / "prompts.jsonl"),
            out=str(root / "prep"),
            regenerate=True,
            regen=RegenConfig(max_new_tokens=48),
            progress=False,
        )
    ).run()
    Dumper(
        DumpConfig(
            target=target,
            data=str(root / "prep"),
            out=str(root / "dump"),
            dtype="float32",
            progress=False,
            capture=CaptureConfig(aux_indices=[1, 2, 3]),
        )
    ).run()
    Standardizer(
        StandardizeConfig(
            dumps=[str(root / "dump")], out=str(root / "std"), draft_vocab_size=320, eval_fraction=0.1, progress=False
        )
    ).run()
    trainer = Trainer(
        TrainConfig(
            data=str(root / "std"),
            target=target,
            out=str(root / "train"),
            progress=False,
            **train_sections(ttt_length=3, epochs=20, lr=3e-3, max_tokens_per_batch=800),
        )
    )
    trainer.run()
    trainer.close()
    Exporter(ExportConfig(run=str(root / "train"), out=str(root / "export"))).run()
    return root
