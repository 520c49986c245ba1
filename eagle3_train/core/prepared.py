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
from eagle3_train.core.vocab import VocabMap, build_vocab_map, capped_draft_size, count_tokens

logger = logging.getLogger(__name__)

COUNT_CHUNK = 4096  # rows whose tokens are counted at a time (bounds the memory of a count)


class PreparedData:
    """One prepared directory, its rows readable by index.

    Args:
        directory: eagle3-prepare's ``out``.
    """

    def __init__(self, directory: str | os.PathLike):
        from datasets import load_from_disk

        self.path = Path(directory).expanduser()
        self.manifest = read_manifest(self.path, "prepare")
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
            raise ContractError(
                f"{self.path} was prepared with the tokenizer of {have.path} "
                f"(tokenizer_hash {have.tokenizer_hash[:12]}), but target {name} tokenises "
                f"differently ({mine.tokenizer_hash[:12]}): prepare the data with this target"
            )
        if have.config_hash != mine.config_hash:
            logger.info(f"note: data prepared with {have.path}, running {mine.path} (same tokenizer, other model)")
        return TargetIdentity(
            mine.path, mine.model_type, mine.config_hash, mine.tokenizer_hash, have.chat_template_hash
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


def prepared_vocab(
    prepared: PreparedData, eval_fraction: float, seed: int, draft_vocab_size: int, target_vocab_size: int
) -> tuple[VocabMap, np.ndarray]:
    """The draft vocab map of a prepared dataset and its held-out sample ids: the loss-masked tokens
    of the samples :func:`~eagle3_train.core.split.split_eval` keeps for training, counted whole -- the
    map eagle3-standardize counts from a dump of the same data with the same fraction and seed."""
    eval_ids = split_eval(prepared.sample_ids, eval_fraction, seed)
    counts = prepared.token_counts(~np.isin(prepared.sample_ids, eval_ids), target_vocab_size)
    return build_vocab_map(counts, capped_draft_size(draft_vocab_size, target_vocab_size)), eval_ids
