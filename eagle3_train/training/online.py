"""Online training (``eagle3-train source=online data=<prepared>``): the frozen target runs in the
training loop on each micro-batch and nothing is written to disk.

Each rank holds the whole target (``online.dtype``: bf16 on GPU, fp32 on CPU), reads its
micro-batches of token ids from the prepared dataset exactly as offline training reads them from
shards (same sample-id order, token budget, epochs and rank assignment: eagle3_train/training/data.py), and
turns each into the states a dump would have stored with :func:`eagle3_train.core.capture.capture`,
the forward pass the dump runs. What follows is the offline step itself: the target distribution
from ``last_hidden`` and the target lm_head, the TTT loss, DeepSpeed's step.

The vocab map is the one eagle3-standardize counts from a dump of the same data (the loss-masked
tokens of the training split, held out by the same rule: :mod:`eagle3_train.core.split`): built at start
and saved as ``<out>/vocab_map.safetensors``, or read from ``prepared.vocab_map``. So an online run
and an offline run of the same data and options train the same head (a test checks losses and
weights).

Overlap (``online.overlap``, GPU): micro-batch i+1's target forward is queued on a side CUDA stream
before the draft's step on micro-batch i, so the GPU always has the next forward to run while the
step's host-side work (its many small launches) catches up; the states are handed to the main stream
through an event. Tensor parallelism of the target is left out: a rank holds the whole target.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from eagle3_train.core.capture import capture, compile_layers
from eagle3_train.core.contract import (
    MANIFEST_NAME,
    CaptureSpec,
    check_dtype,
    default_aux_indices,
    validate_aux_indices,
)
from eagle3_train.core.dist import DistInfo, barrier
from eagle3_train.core.errors import ConfigError, ContractError, check_numbers
from eagle3_train.core.prepared import PreparedData, PreparedSet, prepared_data, prepared_vocab
from eagle3_train.core.split import EVAL_FRACTION, SPLIT_SEED, check_fraction, split_eval
from eagle3_train.core.stagedir import hold_lock
from eagle3_train.core.vocab import DRAFT_VOCAB_SIZE, VocabMap, load_vocab_map
from eagle3_train.engines.rules import serving_warning
from eagle3_train.targets import Target, load_target
from eagle3_train.training.data import Batch, Source, pad_tokens

logger = logging.getLogger(__name__)

VOCAB_FILE = "vocab_map.safetensors"  # in the run directory, when built at start


@dataclass
class PreparedConfig:
    """Training from a prepared dataset, whoever computes the states (``prepared.*``, with
    ``source=online`` and ``source=served``): which target layers, the draft vocab, the held-out
    split and more directories beside ``data=``."""

    aux_indices: list[int] | None = None
    """HF indices captured (null: [2, N//2, N-3]); one the target has not is refused before training"""
    draft_vocab_size: int = DRAFT_VOCAB_SIZE  # counted over the training split's loss-masked tokens (capped at the target's vocab), as eagle3-standardize counts
    vocab_map: str | None = None
    """use this vocab_map.safetensors instead (eagle3-standardize only_vocab=true data=<prepared>, or a standardized dir's)"""
    extra_data: list[str] = field(default_factory=list)
    """more prepared directories trained on beside data= (disjoint sample ids, the same tokenizer and template: e.g. your own prompts answered by the target, eagle3-prepare repeat=, beside synthesized ones)"""
    eval_fraction: float = EVAL_FRACTION  # samples held out, by eagle3-standardize's rule (its eval_fraction=)
    split_seed: int = SPLIT_SEED  # seed of that rule (eagle3-standardize's seed=)

    def __post_init__(self) -> None:
        check_numbers(self, "prepared.", positive=("draft_vocab_size",))
        check_fraction(self.eval_fraction, "prepared.eval_fraction")


@dataclass
class OnlineConfig:
    """The target in the training loop, in this process (``online.*``, with ``source=online``)."""

    dtype: str = "auto"  # the target runs in: auto = bfloat16 on GPU, float32 on CPU
    overlap: bool = True
    """GPU: the next micro-batch's target forward runs on a side CUDA stream during this one's draft step"""
    attn_implementation: str | None = None  # passed to transformers (sdpa, flash_attention_2, eager)
    trust_remote_code: bool = False  # let transformers run the target repository's own code
    compile: bool = False
    """torch.compile the target's decoder layers (dynamic shapes; the first micro-batch compiles): each layer launches a few fused kernels instead of dozens, for a small target whose step the host's launches bound; the states equal the eager forward's within the dtype's tolerance"""

    def __post_init__(self) -> None:
        check_dtype(self.dtype, "online.dtype", auto=True)


@dataclass
class Tokens:
    """A micro-batch before the target has run on it: right-padded token ids (host memory)."""

    input_ids: torch.Tensor  # int64 [B, T]
    loss_mask: torch.Tensor  # bool [B, T]
    lengths: torch.Tensor  # int64 [B]
    sample_ids: torch.Tensor  # int64 [B]

    def pin(self) -> Tokens:
        """The same batch in page-locked memory (asynchronous copies to the GPU)."""
        return Tokens(
            self.input_ids.pin_memory(), self.loss_mask.pin_memory(), self.lengths.pin_memory(), self.sample_ids
        )


class PreparedSplit:
    """The samples of one split of a prepared dataset, in sample-id order, readable by index (the
    counterpart of :class:`eagle3_train.training.data.ShardSplit`).

    Args:
        prepared: the prepared dataset.
        sample_ids: the split's sample ids.
        max_length: samples longer than this are cut (their tail is not trained on).
    """

    def __init__(self, prepared: PreparedData | PreparedSet, sample_ids: np.ndarray, max_length: int):
        self.prepared = prepared
        rows = np.flatnonzero(np.isin(prepared.sample_ids, sample_ids))
        self.rows = rows[np.argsort(prepared.sample_ids[rows], kind="stable")]
        self.sample_id = prepared.sample_ids[self.rows]
        self.length = np.minimum(prepared.num_tokens[self.rows], max_length)

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: np.ndarray) -> Tokens:
        """Read and right-pad the samples ``indices`` (positions in this split's index)."""
        lengths = self.length[indices]
        rows = [self.prepared.tokens(int(self.rows[i])) for i in indices]
        ids, mask = pad_tokens([r[0] for r in rows], [r[1] for r in rows], lengths)
        return Tokens(ids, mask, torch.from_numpy(lengths.copy()), torch.from_numpy(self.sample_id[indices]))


def capture_indices(aux_indices: list[int] | None, num_hidden_layers: int) -> list[int]:
    """``prepared.aux_indices`` checked against the target, or the default [2, N//2, N-3]."""
    n = num_hidden_layers
    return list(default_aux_indices(n) if aux_indices is None else validate_aux_indices(list(aux_indices), n))


class PreparedSource(Source):
    """A prepared dataset read for training with the target in the loop: its samples split, its
    vocab map counted and its micro-batches planned as eagle3-standardize and offline training
    would (``online.*``). Where the states come from is the subclass's: the target in this process
    (:class:`OnlineSource`) or a serving engine (eagle3_train/training/served.py).

    Args:
        data: the prepared directory (eagle3-prepare's out).
        target: the target's name, for messages and the capture's identity.
        cfg: the ``prepared.*`` options.
        about: the target's config and tokenizer (its weights need not be loaded).
        dist: this rank.
    """

    def __init__(self, data: str, target: str, cfg: PreparedConfig, about: Target, dist: DistInfo):
        self.cfg = cfg
        self.prepared = prepared_data(data, cfg.extra_data)
        self.where = str(self.prepared.path)
        self.data_fingerprint = self.prepared.fingerprint
        n = about.num_hidden_layers
        self.aux = capture_indices(cfg.aux_indices, n)
        warning = serving_warning(list(self.aux), about.identity.model_type, n)
        if warning and dist.rank == 0:
            logger.warning(f"eagle3-train: warning: {warning}")
        self.identity = self.prepared.identity_for(about, target)
        self.about = about

    def _split(self, dtype: str, max_length: int, out: Path, dist: DistInfo) -> None:
        """The capture spec (the states arrive in ``dtype``), the vocab map and the two splits."""
        a = self.about
        self.spec = CaptureSpec(tuple(self.aux), a.num_hidden_layers, a.hidden_size, a.vocab_size, dtype, self.identity)
        self.vocab, self.vocab_sha = self._vocab(out, dist)
        eval_ids = split_eval(self.prepared.sample_ids, self.cfg.eval_fraction, self.cfg.split_seed)
        train_ids = np.setdiff1d(self.prepared.sample_ids, eval_ids)
        self.train_split = PreparedSplit(self.prepared, train_ids, max_length)
        self.eval_split = PreparedSplit(self.prepared, eval_ids, max_length)

    def _vocab(self, out: Path, dist: DistInfo) -> tuple[VocabMap, str]:
        """The map of ``prepared.vocab_map``, or the one counted from the training split, built by
        rank 0 into the run directory."""
        cfg, v = self.cfg, self.spec.vocab_size
        if cfg.vocab_map is not None:
            self._check_split_of(Path(cfg.vocab_map).expanduser())
            return load_vocab_map(cfg.vocab_map, v)
        path = out / VOCAB_FILE
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            hold_lock(
                out, "training run"
            )  # the run's own lock (its claim takes it later): a second run is refused here
            prepared_vocab(self.prepared, cfg.eval_fraction, cfg.split_seed, cfg.draft_vocab_size, v)[0].save(path)
        barrier()
        return load_vocab_map(path, v)

    def _check_split_of(self, vocab_map: Path) -> None:
        """A map whose directory records the split it was counted over (eagle3-standardize's
        manifest) must have held out what this run holds out: else it counted eval samples."""
        manifest = vocab_map.parent / MANIFEST_NAME
        if not manifest.is_file():
            return
        split = json.loads(manifest.read_text()).get("split")
        mine = {"seed": self.cfg.split_seed, "eval_fraction": self.cfg.eval_fraction}
        if split is not None and split != mine:
            show = lambda d: json.dumps(d, sort_keys=True)  # noqa: E731
            raise ContractError(
                f"{vocab_map} was counted over the split {show(split)} (its {manifest.name}), this run "
                f"holds out {show(mine)}: set prepared.split_seed / prepared.eval_fraction to match"
            )


class OnlineSource(PreparedSource):
    """The frozen target on this rank, turning each micro-batch of tokens into its states.

    Args:
        data: the prepared directory (eagle3-prepare's out).
        target: the target's name (eagle3_train.targets); ``loaded`` when it is already loaded.
        cache_dir: where GGUF targets are converted once.
        cfg: the ``online.*`` options.
        max_length: samples are cut at this many tokens (the token budget of a micro-batch).
        out: the run directory (where a vocab map built at start is saved).
        dist: this rank; the target runs on its device.
        dtype: the training dtype the states are handed over in.
        loaded: an already loaded target (a benchmark's random weights); None loads ``target``.
    """

    def __init__(
        self,
        data: str,
        target: str,
        cache_dir: str | None,
        cfg: PreparedConfig,
        online: OnlineConfig,
        max_length: int,
        out: Path,
        dist: DistInfo,
        dtype: torch.dtype,
        loaded: Target | None = None,
    ):
        self.device, self.dtype, self.online = dist.device, dtype, online
        # config and tokenizer first: a capture the target cannot provide (a layer it does not have,
        # N itself) and data of another tokenizer are refused before its weights are loaded
        about = loaded or load_target(
            target, cache_dir=cache_dir, load_model=False, trust_remote_code=online.trust_remote_code
        )
        super().__init__(data, target, cfg, about, dist)
        self.target = loaded or self._load(target, cache_dir)
        self.model = self.target.model.requires_grad_(False).eval()
        if online.compile:
            compile_layers(self.model, "online.compile=true")
        model_dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self._split(model_dtype, max_length, out, dist)
        self.states_from = {"engine": "transformers", "version": transformers.__version__, "dtype": model_dtype}
        self.stream = None
        if online.overlap and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the weights' copies are done before another stream reads them
            self.stream = torch.cuda.Stream(self.device)

    def _load(self, target: str, cache_dir: str | None) -> Target:
        kwargs = {"attn_implementation": self.online.attn_implementation} if self.online.attn_implementation else {}
        logger.info(f"loading target {target} ({self.online.dtype}) on {self.device}")
        return load_target(
            target,
            cache_dir=cache_dir,
            dtype=self.online.dtype,
            device=str(self.device),
            trust_remote_code=self.online.trust_remote_code,
            model_kwargs=kwargs,
        )

    def target_tensors(self, names: tuple[str, ...]) -> tuple[Any, dict[str, torch.Tensor]]:
        """The loaded target's own tensors (on its device: the lm_head is not copied again)."""
        every = {
            "embed": self.model.get_input_embeddings(),
            "head": self.model.get_output_embeddings(),
            "norm": getattr(self.model.get_decoder(), "norm", None),
        }
        missing = [n for n in names if every[n] is None]
        if missing:
            raise ConfigError(f"target {self.spec.target.path} has no {missing} module where transformers keeps it")
        return self.target.config, {n: every[n].weight.detach() for n in names}

    @torch.no_grad()
    def states(self, tokens: Tokens) -> Batch:
        """The target's forward on one micro-batch: the states a dump would store for it, padded
        as shards are (zeros past each row's end), on the device in the training dtype."""
        dev = self.device
        ids, mask, lengths = (
            t.to(dev, non_blocking=True) for t in (tokens.input_ids, tokens.loss_mask, tokens.lengths)
        )
        # No attention mask: right padding under causal attention never reaches a real token.
        states = capture(self.model, ids, None, self.spec.aux_indices)
        pad = (torch.arange(ids.shape[1], device=dev)[None, :] >= lengths[:, None])[..., None]  # [B, T, 1]
        aux = states.aux(self.spec.aux_indices).masked_fill_(pad, 0)  # [B, T, n_aux*H], a new tensor
        last = states.last_hidden.masked_fill(pad, 0)  # [B, T, H]
        return Batch(aux.to(self.dtype), last.to(self.dtype), ids, mask, lengths, tokens.sample_ids)

    def device_batches(self, batches: Iterator[Tokens]) -> Iterator[Batch]:
        """The states of each micro-batch; with ``online.overlap``, one micro-batch ahead (see the
        module docstring)."""
        if not self.online.overlap:
            for tokens in batches:
                yield self.states(tokens)
            return
        ahead = None
        for tokens in batches:
            launched = self._launch(tokens)
            if ahead is not None:
                yield self._ready(*ahead)
            ahead = launched
        if ahead is not None:
            yield self._ready(*ahead)

    def _launch(self, tokens: Tokens) -> tuple[Batch, Any]:
        """Queue a micro-batch's forward on the side stream (on the CPU: run it)."""
        if self.stream is None:
            return self.states(tokens), None
        with torch.cuda.stream(self.stream):
            batch = self.states(tokens)
            done = torch.cuda.Event()
            done.record(self.stream)
        return batch, done

    def _ready(self, batch: Batch, done: Any) -> Batch:
        """Hand a launched micro-batch to the main stream: its work waits for the forward, and the
        allocator keeps the states' memory from the side stream until the main stream is done."""
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            for t in (batch.aux_hidden, batch.last_hidden, batch.input_ids, batch.loss_mask, batch.lengths):
                t.record_stream(main)
        return batch
