"""A prepared dataset (``eagle3-prepare``'s out) as the stages that run the target on it read it:
the dump (data_prep/dump), online training (eagle3_train/training/online.py) and the vocab map of
``eagle3-standardize only_vocab=true data=<prepared>``.

``<prepared>/dataset/`` (``datasets.load_from_disk``) holds one row per sample: ``sample_id``,
``input_ids``, ``loss_mask``, ``num_tokens``; ``<prepared>/manifest.json`` its fingerprint and the
identity of the target it was tokenised for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_train.core.contract import TargetIdentity, read_manifest
from eagle3_train.core.errors import BadInputError, ContractError, IncompleteError
from eagle3_train.core.split import split_eval
from eagle3_train.core.tokenizer_spec import tokenizer_differences, tokenizer_facts
from eagle3_train.core.vocab import VocabMap, build_vocab_map, capped_draft_size, count_tokens

logger = logging.getLogger(__name__)

COUNT_CHUNK = 4096  # rows whose tokens are counted at a time (bounds the memory of a count)


class PreparedData:
    """One prepared directory, its rows readable by index.

    Args:
        directory: eagle3-prepare's ``out``.
        option: the user's option that named it (``data``), for messages.
    """

    def __init__(self, directory: str | os.PathLike, option: str | None = None):
        from datasets import load_from_disk

        self.path = Path(directory).expanduser()
        self.manifest = read_manifest(self.path, "prepare", option=option)
        dataset = self.path / self.manifest.get("dataset", "dataset")
        if not dataset.is_dir():
            raise IncompleteError(f"prepared directory {self.path} has a manifest but no {dataset.name}/")
        self.dataset = load_from_disk(str(dataset)).with_format("numpy")
        self.sample_ids = self.dataset["sample_id"][:].astype(np.int64)  # row -> sample id
        if len(np.unique(self.sample_ids)) != len(self.dataset):
            raise BadInputError(f"{dataset}: sample_id repeats; re-run eagle3-prepare")
        self.num_tokens = self.dataset["num_tokens"][:].astype(np.int64)  # row -> tokens

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def target(self) -> TargetIdentity:
        """The target the data was tokenised (and its chat template rendered) for."""
        return TargetIdentity.from_dict(self.manifest["target"])

    def identity_for(self, target: Any, name: str) -> TargetIdentity:
        """The identity of ``target`` (a :class:`eagle3_train.targets.Target` named ``name``) as a
        capture of this data records it: the prepared ids must mean the same to it (same
        tokenizer), and the chat template is the one the data was rendered with."""
        have, mine = self.target, target.identity
        if have.tokenizer_hash != mine.tokenizer_hash:
            how = ""
            if "tokenizer" in self.manifest:  # (what it recorded: manifests since 2026-12-07)
                how = tokenizer_differences(self.manifest["tokenizer"], tokenizer_facts(target.tokenizer))
                how = f" ({how})" if how else ""
            raise ContractError(
                f"{self.path} was prepared with the tokenizer of {have.path} "
                f"(tokenizer_hash {have.tokenizer_hash[:12]}), but target {name} tokenises "
                f"differently ({mine.tokenizer_hash[:12]}){how}: prepare the data with this target, "
                "where it trains"
            )
        if have.config_hash != mine.config_hash:
            logger.info(f"note: data prepared with {have.path}, running {mine.path} (same tokenizer, other model)")
        return TargetIdentity(
            mine.path,
            mine.model_type,
            mine.config_hash,
            mine.tokenizer_hash,
            have.chat_template_hash,
            have.chat_template_kwargs,
        )

    def tokens(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` and ``loss_mask`` of one row."""
        r = self.dataset[int(row)]
        return r["input_ids"], r["loss_mask"]

    def token_counts(self, keep: np.ndarray, vocab_size: int) -> torch.Tensor:
        """int64 [vocab_size] counts of the loss-masked tokens of the rows where ``keep`` (bool
        per row) holds, read a chunk of rows at a time from the Arrow columns."""
        import pyarrow.compute as pc

        arrow = self.dataset.with_format("arrow")
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for start in range(0, len(arrow), COUNT_CHUNK):
            table = arrow[start : start + COUNT_CHUNK]
            ids, mask = (table.column(k).combine_chunks() for k in ("input_ids", "loss_mask"))
            token_keep = np.repeat(keep[start : start + len(table)], pc.list_value_length(ids).to_numpy())
            flat_ids, flat_mask = (
                np.asarray(pc.list_flatten(a).to_numpy(zero_copy_only=False))[token_keep] for a in (ids, mask)
            )
            counts += count_tokens(torch.from_numpy(flat_ids.astype(np.int64)), torch.from_numpy(flat_mask), vocab_size)
        return counts


class PreparedSet:
    """Several prepared directories read as one (online training's ``data`` and ``prepared.extra_data``):
    rows in the parts' order, their sample ids disjoint, all tokenised by one tokenizer with one
    chat template. The interface of :class:`PreparedData`.

    Args:
        parts: the prepared directories (two or more).
    """

    def __init__(self, parts: list[PreparedData]):
        from eagle3_train.core.fileio import sha256_json

        self.parts = parts
        self.path = parts[0].path
        self.sample_ids = np.concatenate([p.sample_ids for p in parts])
        self.num_tokens = np.concatenate([p.num_tokens for p in parts])
        self.starts = np.cumsum([0] + [len(p.sample_ids) for p in parts])  # the first row of each part
        if len(np.unique(self.sample_ids)) != len(self.sample_ids):
            seen: dict[int, Path] = {}
            for p in parts:
                clash = next((int(i) for i in p.sample_ids if int(i) in seen), None)
                if clash is not None:
                    raise BadInputError(
                        f"sample id {clash} is in both {seen[clash]} and {p.path}: prepare them with disjoint "
                        f"sample_id_offset= ranges"
                    )
                seen.update({int(i): p.path for i in p.sample_ids})
        first = parts[0].target
        for p in parts[1:]:
            if (p.target.tokenizer_hash, p.target.chat_template_hash, p.target.chat_template_kwargs) != (
                first.tokenizer_hash,
                first.chat_template_hash,
                first.chat_template_kwargs,
            ):
                raise ContractError(
                    f"{p.path} was tokenised with another tokenizer, chat template or chat_template_kwargs than {parts[0].path} "
                    f"(prepared for {p.target.path} and {first.path}): prepare both with the same target and template"
                )
        self.fingerprint = sha256_json([p.fingerprint for p in parts])

    @property
    def target(self) -> TargetIdentity:
        return self.parts[0].target

    def identity_for(self, target: Any, name: str) -> TargetIdentity:
        return [p.identity_for(target, name) for p in self.parts][0]  # each part checked

    def tokens(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        part = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.parts[part].tokens(int(row - self.starts[part]))

    def token_counts(self, keep: np.ndarray, vocab_size: int) -> torch.Tensor:
        return sum(
            (p.token_counts(keep[a:b], vocab_size) for p, a, b in zip(self.parts, self.starts, self.starts[1:])),
            torch.zeros(vocab_size, dtype=torch.int64),
        )


def prepared_data(data: str | os.PathLike, extra: list[str] | None = None) -> PreparedData | PreparedSet:
    """The prepared directory ``data`` (the ``data`` option), or it and ``extra`` (the
    ``prepared.extra_data`` option) read as one."""
    parts = [PreparedData(data, "data"), *(PreparedData(d, "prepared.extra_data") for d in extra or [])]
    return parts[0] if len(parts) == 1 else PreparedSet(parts)


def prepared_vocab(
    prepared: PreparedData | PreparedSet, eval_fraction: float, seed: int, draft_vocab_size: int, target_vocab_size: int
) -> tuple[VocabMap, np.ndarray]:
    """The draft vocab map of a prepared dataset and its held-out sample ids: the loss-masked tokens
    of the samples :func:`~eagle3_train.core.split.split_eval` keeps for training, counted whole -- the
    map eagle3-standardize counts from a dump of the same data with the same fraction and seed."""
    eval_ids = split_eval(prepared.sample_ids, eval_fraction, seed)
    counts = prepared.token_counts(~np.isin(prepared.sample_ids, eval_ids), target_vocab_size)
    return build_vocab_map(counts, capped_draft_size(draft_vocab_size, target_vocab_size)), eval_ids
