"""``eagle3-standardize``: dumps -> training shards (chosen aux layers concatenated) + vocab map.

    eagle3-standardize dumps=[runs/x/dump] out=runs/x/std aux_indices=[2,15,27] draft_vocab_size=32000

Output (docs/concepts/storage.md): ``<out>/train/*.safetensors`` and ``<out>/eval/*.safetensors`` holding
``input_ids``, ``loss_mask``, ``cu_seqlens``, ``sample_ids``, ``aux_hidden`` [T, n_aux*H] (the
chosen ``hidden.<k>`` concatenated in ascending k) and ``last_hidden`` [T, H] (with ``storage=fp8``
as e4m3 with ``aux_hidden.scale`` [T, n_aux] and ``last_hidden.scale`` [T, 1]: eagle3_train/core/storage.py);
``<out>/vocab_map.safetensors`` (``d2t``, ``t2d``, ``token_counts``, counted over the training
split's loss-masked tokens); ``<out>/manifest.json`` last.

Each input shard becomes (at most) one train and one eval shard, processed in parallel by
``workers`` threads, so memory stays bounded whatever the dataset size: about two input shards'
worth of tensors per worker. A finished input shard is recognised by its outputs' records, so an
interrupted run, started again, does only the rest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.contract import CaptureSpec, check_storage, differences, read_manifest, validate_aux_indices
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, Eagle3Error, check_numbers
from eagle3_train.core.fileio import remove_temporaries, sha256_file
from eagle3_train.core.formats import (
    RECORD_SUFFIX,
    SHARD_SUFFIX,
    ShardRecord,
    finished_records,
    read_keys,
    write_shard,
)
from eagle3_train.core.log import LogConfig, progress_bar
from eagle3_train.core.prepared import PreparedData, prepared_vocab
from eagle3_train.core.split import EVAL_FRACTION, SPLIT_SEED, check_fraction, split_eval
from eagle3_train.core.stagedir import StageDir
from eagle3_train.core.storage import FP8_STORAGE, concat, convert, scale_key
from eagle3_train.core.threads import settle_torch_threads
from eagle3_train.core.vocab import (
    DRAFT_VOCAB_SIZE,
    VocabMap,
    build_vocab_map,
    capped_draft_size,
    count_tokens,
    load_vocab_map,
)
from eagle3_train.targets import load_target, resolve_dtype

logger = logging.getLogger(__name__)

STAGE = "standardize"
VOCAB_STAGE = "vocab"  # only_vocab=true data=<prepared>: a directory with just the map
VOCAB_FILE = "vocab_map.safetensors"


@dataclass
class StandardizeConfig:
    """Options of ``eagle3-standardize`` (``conf/standardize.yaml``)."""

    dumps: list[str] = field(default_factory=list)  # dump directories to read (capture specs must agree)
    out: str = MISSING  # output directory (train/, eval/, vocab_map.safetensors, manifest.json)
    aux_indices: list[int] | None = None  # HF indices to concatenate (null: the dumps' aux indices)
    draft_vocab_size: int = DRAFT_VOCAB_SIZE  # size of the draft lm_head's vocab (capped at the target's)
    eval_fraction: float = EVAL_FRACTION  # share of samples held out for evaluation
    max_samples: int | None = None
    """only the samples with the N lowest ids (a data-scaling point from one dump); null: all"""
    seed: int = SPLIT_SEED  # decides which samples are held out
    vocab_map: str | None = None  # reuse this vocab_map.safetensors instead of counting a new one
    storage: str | None = None
    """how the shards store the states: null: as the dumps do; dtype: fp8 dumps read back in their dtype; fp8: quantize (README: Compact storage)"""
    only_vocab: bool = False  # rebuild only the vocab map of the standardized directory `out` (or, with data=, write one for online training)
    data: str | None = None
    """with only_vocab=true: a prepared directory whose training split's loss-masked tokens are counted into out/vocab_map.safetensors (the map a dump of it would get; for eagle3-train source=online)"""
    target: str | None = None  # with data=: the target the map is for (null: the one the data was prepared with)
    cache_dir: str | None = None  # where GGUF targets are converted once (target=embedded)
    workers: int = 0  # threads processing shards in parallel (0: one per core)
    verify_inputs: bool = True  # check each dump shard's sha256 against its record before use
    progress: bool | None = None
    """null: a bar on a terminal, else a progress line every logging.progress_every_s seconds; true: a bar always; false: neither"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        check_numbers(self, positive=("draft_vocab_size", "max_samples"), non_negative=("workers",))
        check_fraction(self.eval_fraction)
        if self.storage is not None:
            check_storage(self.storage)
        if not self.only_vocab and not self.dumps:
            raise ConfigError("dumps=[<dump dir>, ...] is required (or only_vocab=true with out=<standardized dir>)")
        if self.data is not None and (not self.only_vocab or self.dumps or self.vocab_map):
            raise ConfigError(
                "data=<prepared dir> counts a new vocab map: use it with only_vocab=true, without dumps= and vocab_map="
            )


ConfigStore.instance().store(name="standardize_schema", node=StandardizeConfig)


@dataclass
class Source:
    """One input shard and the samples it holds."""

    dump: int  # index into cfg.dumps
    record: ShardRecord
    path: Path
    sample_ids: np.ndarray
    keep: np.ndarray | None = None  # bool per sample: inside max_samples (None: all)

    @property
    def kept(self) -> np.ndarray:
        return np.ones(len(self.sample_ids), dtype=bool) if self.keep is None else self.keep

    @property
    def out_name(self) -> str:
        return f"{self.dump:03d}-{self.record.name}"


class Standardizer:
    """Runs the standardize stage (see the module docstring)."""

    def __init__(self, cfg: StandardizeConfig):
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.workers = cfg.workers or os.cpu_count() or 1

    # -- vocab only ------------------------------------------------------------------------------

    def rebuild_vocab(self) -> dict[str, Any]:
        """``only_vocab=true``: count the standardized training split again, write a new map."""
        manifest = read_manifest(self.out, STAGE)
        spec = CaptureSpec.from_dict(manifest["capture"])
        vocab, sha = self.make_vocab(spec.vocab_size)
        manifest["vocab"] = self.vocab_summary(vocab, sha)
        manifest["config"] = config_dict(self.cfg)
        out = self.stage_dir(manifest["request"] | {"vocab": self.vocab_request(spec.vocab_size)})
        out.claim(replace=True)  # the same data with another vocab: the shards stay
        body = {
            k: v
            for k, v in manifest.items()
            if k not in ("stage", "format_version", "eagle3_train_version", "created_at", "request")
        }
        manifest = out.write_manifest(body)
        logger.info(
            f"eagle3-standardize: new vocab map of {vocab.draft_vocab_size} tokens "
            f"({vocab.coverage():.2%} of training tokens) -> {self.out / VOCAB_FILE}"
        )
        return manifest

    def vocab_of_prepared(self) -> dict[str, Any]:
        """``only_vocab=true data=<prepared>``: the map of the prepared data's training split
        (:func:`~eagle3_train.core.prepared.prepared_vocab`), in ``out`` with a manifest of stage
        ``vocab`` that records the split it was counted over (online training checks it)."""
        cfg = self.cfg
        assert cfg.data is not None  # how this method is reached: only_vocab=true data=...
        prepared = PreparedData(cfg.data, "data")
        name = cfg.target or prepared.target.path
        target = load_target(name, cache_dir=cfg.cache_dir, load_model=False)
        identity = prepared.identity_for(target, name)
        vocab, eval_ids = prepared_vocab(prepared, cfg.eval_fraction, cfg.seed, cfg.draft_vocab_size, target.vocab_size)
        split = {"seed": cfg.seed, "eval_fraction": cfg.eval_fraction}
        out = StageDir(
            self.out,
            VOCAB_STAGE,
            {
                "prepared_fingerprint": prepared.fingerprint,
                "target": identity.to_dict(),
                "split": split,
                "vocab": self.vocab_request(target.vocab_size),
            },
            what="vocab map",
        )
        out.claim(replace=True)  # a map alone: nothing else to keep
        sha = vocab.save(self.out / VOCAB_FILE)
        manifest = out.write_manifest(
            {
                "vocab": self.vocab_summary(vocab, sha),
                "split": split,
                "target": identity.to_dict(),
                "prepared": {"path": str(prepared.path.resolve()), "fingerprint": prepared.fingerprint},
                "counts": {"train_samples": len(prepared.sample_ids) - len(eval_ids), "eval_samples": len(eval_ids)},
                "config": config_dict(cfg),
            }
        )
        logger.info(
            f"eagle3-standardize: vocab map of {vocab.draft_vocab_size} tokens ({vocab.coverage():.2%} of the "
            f"training split's tokens) from {prepared.path} -> {self.out / VOCAB_FILE}"
        )
        return manifest

    def make_vocab(self, target_vocab: int) -> tuple[VocabMap, str]:
        """The vocab map: reused from ``vocab_map=`` or counted over ``out/train``."""
        if self.cfg.vocab_map:
            vocab, sha = load_vocab_map(self.cfg.vocab_map, target_vocab)
            if Path(self.cfg.vocab_map).expanduser().resolve() != (self.out / VOCAB_FILE).resolve():
                shutil.copyfile(Path(self.cfg.vocab_map).expanduser(), self.out / VOCAB_FILE)
            return vocab, sha
        size = capped_draft_size(self.cfg.draft_vocab_size, target_vocab)
        counts = torch.zeros(target_vocab, dtype=torch.int64)
        for rec in finished_records(self.out / "train"):
            t = read_keys(self.out / "train" / f"{rec.name}{SHARD_SUFFIX}", ("input_ids", "loss_mask"))
            counts += count_tokens(t["input_ids"], t["loss_mask"], target_vocab)
        vocab = build_vocab_map(counts, size)
        return vocab, vocab.save(self.out / VOCAB_FILE)

    def vocab_request(self, target_vocab: int) -> dict[str, Any]:
        """What decides the vocab map: a reused file (by hash) or the draft size counted for."""
        if self.cfg.vocab_map:
            return {"vocab_map": load_vocab_map(self.cfg.vocab_map, target_vocab)[1]}
        return {"draft_vocab_size": min(self.cfg.draft_vocab_size, target_vocab)}  # (capped as make_vocab caps it)

    @staticmethod
    def vocab_summary(vocab: VocabMap, sha: str) -> dict[str, Any]:
        return {
            "file": VOCAB_FILE,
            "sha256": sha,
            "draft_vocab_size": vocab.draft_vocab_size,
            "target_vocab_size": vocab.target_vocab_size,
            "distinct_tokens": int((vocab.token_counts > 0).sum()),
            "coverage": vocab.coverage(),
        }

    # -- the full run ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        if self.cfg.only_vocab:
            return self.vocab_of_prepared() if self.cfg.data else self.rebuild_vocab()
        dumps = [read_manifest(Path(d).expanduser(), "dump", option="dumps") for d in self.cfg.dumps]
        spec = self.check_dumps(dumps)
        sources = self.sources(dumps)
        all_ids = np.concatenate([s.sample_ids for s in sources]) if sources else np.zeros(0, dtype=np.int64)
        if self.cfg.max_samples is not None:  # the lowest ids: prepare numbers samples in input order
            if self.cfg.max_samples > len(all_ids):
                logger.warning(
                    f"warning: max_samples={self.cfg.max_samples} but the dumps hold {len(all_ids)} samples; using all"
                )
            all_ids = np.sort(all_ids)[: self.cfg.max_samples]
            sources = [replace(s, keep=np.isin(s.sample_ids, all_ids)) for s in sources]
        eval_ids = split_eval(all_ids, self.cfg.eval_fraction, self.cfg.seed)
        request = {
            "capture": spec.to_dict(),
            "dumps": [
                {
                    "path": str(Path(d).expanduser().resolve()),
                    "created_at": m["created_at"],
                    "shards": [r["sha256"] for r in m["shards"]],
                }
                for d, m in zip(self.cfg.dumps, dumps)
            ],
            "eval_fraction": self.cfg.eval_fraction,
            "seed": self.cfg.seed,
            "max_samples": self.cfg.max_samples,
            "vocab": self.vocab_request(spec.vocab_size),
        }
        done = self.claim(request)
        if done is not None:
            return done
        stats = self.convert(sources, spec, eval_ids)
        vocab, sha = self.make_vocab(spec.vocab_size)
        return self.finalize(spec, request, dumps, stats, vocab, sha, len(eval_ids), len(all_ids))

    def check_dumps(self, dumps: list[dict]) -> CaptureSpec:
        """Dumps must agree on capture and target; the asked layers must be in every dump."""
        specs = [CaptureSpec.from_dict(m["capture"]) for m in dumps]
        for path, spec in zip(self.cfg.dumps[1:], specs[1:]):
            diffs = differences(spec, specs[0])
            if diffs:
                raise ContractError(
                    f"dumps {self.cfg.dumps[0]} and {path} cannot be merged; they differ in:\n  "
                    + "\n  ".join(diffs)
                    + f"\n{self.cfg.dumps[0]}: {json.dumps(specs[0].to_dict(), sort_keys=True)}"
                    + f"\n{path}: {json.dumps(spec.to_dict(), sort_keys=True)}"
                )
        first = specs[0]
        aux = (
            first.aux_indices
            if self.cfg.aux_indices is None
            else validate_aux_indices(list(self.cfg.aux_indices), first.num_hidden_layers)
        )
        for path, m in zip(self.cfg.dumps, dumps):
            missing = [k for k in aux if k not in m["stored_indices"]]
            if missing:
                raise ContractError(
                    f"layers {missing} are not in dump {path}; it holds HF indices {m['stored_indices']} "
                    f"(hidden.<k>); choose aux_indices among them, or dump again with capture.extra_indices"
                )
        self.source_storage = first.storage  # the same in every dump (a difference is refused above)
        return CaptureSpec(
            aux,
            first.num_hidden_layers,
            first.hidden_size,
            first.vocab_size,
            first.dtype,
            first.target,
            self.cfg.storage or first.storage,
        )

    def sources(self, dumps: list[dict]) -> list[Source]:
        """Every input shard with its sample ids; duplicate ids anywhere are refused."""
        sources = []
        seen: dict[int, str] = {}
        for i, (d, m) in enumerate(zip(self.cfg.dumps, dumps)):
            shard_dir = Path(d).expanduser() / "shards"
            for r in m["shards"]:
                rec = ShardRecord.from_dict(r)
                path = shard_dir / f"{rec.name}{SHARD_SUFFIX}"
                if not path.is_file() or path.stat().st_size != rec.bytes:
                    raise BadInputError(f"shard {path} is missing or its size differs from the dump's manifest")
                ids = read_keys(path, ("sample_ids",))["sample_ids"].numpy()
                for sid in ids.tolist():
                    if sid in seen:
                        raise ContractError(
                            f"sample id {sid} is in {seen[sid]} and in {path}: dumps to merge must hold "
                            f"disjoint samples"
                        )
                    seen[sid] = str(path)
                sources.append(Source(i, rec, path, ids))
        return sources

    def claim(self, request: dict) -> dict[str, Any] | None:
        """Reuse a finished output made the same way; refuse one made otherwise."""
        out = self.stage_dir(request)
        if (done := out.finished()) is not None:
            logger.info(f"eagle3-standardize: {self.out} is already complete; nothing to do")
            return done
        out.claim()
        remove_temporaries(self.out)  # a killed run's unrenamed vocab map or manifest (this process holds out=)
        for sub in ("train", "eval"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.out / sub)
        return None

    def stage_dir(self, request: dict) -> StageDir:
        """The output directory for ``request``; when only the vocab differs, the refusal says
        that only_vocab=true rebuilds just the map."""

        def hint(diffs: list[str]) -> str:
            if all(d.startswith("vocab.") for d in diffs):
                return "(only the vocab differs: only_vocab=true rebuilds just the map)"
            return "use another out=, or delete it"

        return StageDir(self.out, STAGE, request, what="standardized output", hint=hint, exclusive=True)

    def convert(self, sources: list[Source], spec: CaptureSpec, eval_ids: np.ndarray) -> dict[str, int]:
        """Write the train/eval shards of every input shard not done yet, in parallel."""
        todo = [s for s in sources if not self._done(s, eval_ids)]
        total = sum(s.record.bytes for s in todo)
        bar = progress_bar(total=total, unit="B", unit_scale=True, desc="standardize", show=self.cfg.progress)
        settle_torch_threads()
        with ThreadPoolExecutor(self.workers) as pool:
            for src in pool.map(lambda s: self._convert_one(s, spec, eval_ids), todo):
                bar.update(src.record.bytes)
        bar.close()
        return {"input_shards": len(sources), "converted_now": len(todo), "bytes_read_now": total}

    def _expected(self, src: Source, eval_ids: np.ndarray) -> dict[str, int]:
        is_eval = np.isin(src.sample_ids, eval_ids)
        return {"train": int((~is_eval & src.kept).sum()), "eval": int(is_eval.sum())}

    def _done(self, src: Source, eval_ids: np.ndarray) -> bool:
        return all(
            n == 0 or (self.out / split / f"{src.out_name}{RECORD_SUFFIX}").is_file()
            for split, n in self._expected(src, eval_ids).items()
        )

    def _convert_one(self, src: Source, spec: CaptureSpec, eval_ids: np.ndarray) -> Source:
        if self.cfg.verify_inputs and sha256_file(src.path) != src.record.sha256:
            raise BadInputError(f"shard {src.path} is corrupt: its sha256 differs from the dump's manifest")
        states = [f"hidden.{k}" for k in spec.aux_indices] + ["last_hidden"]
        stored = states + ([scale_key(k) for k in states] if self.source_storage == FP8_STORAGE else [])
        t = read_keys(src.path, ("input_ids", "loss_mask", "cu_seqlens", "sample_ids", *stored))
        kept = convert(t, states, self.source_storage, spec.storage, resolve_dtype(spec.dtype, "cpu"))
        # [T, H] x n_aux -> [T, n_aux*H], ascending k (the order every engine concatenates in); fp8: scales [T, n_aux]
        hidden = concat(kept, states[:-1], "aux_hidden") | concat(kept, ["last_hidden"], "last_hidden")
        is_eval = torch.from_numpy(np.isin(src.sample_ids, eval_ids))
        lengths = t["cu_seqlens"].diff()
        for split, keep in (("train", ~is_eval & torch.from_numpy(src.kept)), ("eval", is_eval)):
            if not bool(keep.any()):
                continue
            out = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"]} | hidden
            if not bool(keep.all()):
                token_keep = torch.repeat_interleave(keep, lengths)
                out = {k: v[token_keep] for k, v in out.items()}
            out["sample_ids"] = t["sample_ids"][keep]
            out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[keep].cumsum(0)])
            write_shard(self.out / split, src.out_name, out)
        return src

    def finalize(
        self,
        spec: CaptureSpec,
        request: dict,
        dumps: list[dict],
        stats: dict,
        vocab: VocabMap,
        sha: str,
        n_eval: int,
        n_all: int,
    ) -> dict[str, Any]:
        shards = {split: finished_records(self.out / split) for split in ("train", "eval")}
        counts = {
            f"{split}_{what}": sum(getattr(r, f"num_{what}") for r in recs)
            for split, recs in shards.items()
            for what in ("samples", "tokens")
        }
        if counts["train_samples"] + counts["eval_samples"] != n_all or counts["eval_samples"] != n_eval:
            raise Eagle3Error(f"{self.out}: output holds {counts} but the dumps hold {n_all} samples ({n_eval} eval)")
        body = {
            "capture": spec.to_dict(),
            "target": spec.target.to_dict(),
            "sources": [
                {"path": d["path"], "capture": m["capture"], "stored_indices": m["stored_indices"]}
                for d, m in zip(request["dumps"], dumps)
            ],
            "config": config_dict(self.cfg),
            "vocab": self.vocab_summary(vocab, sha),
            "split": {"seed": self.cfg.seed, "eval_fraction": self.cfg.eval_fraction},
            "counts": counts | {"bytes": sum(r.bytes for recs in shards.values() for r in recs)},
            "shards": {split: [r.to_dict() for r in recs] for split, recs in shards.items()},
            "run": stats,
        }
        manifest = self.stage_dir(request).write_manifest(body)
        logger.info(
            f"eagle3-standardize: {counts['train_samples']} train / {counts['eval_samples']} eval samples, "
            f"aux {list(spec.aux_indices)} -> aux_hidden width {len(spec.aux_indices) * spec.hidden_size}; "
            f"draft vocab {vocab.draft_vocab_size} covers {vocab.coverage():.2%} of training tokens -> {self.out}"
        )
        return manifest


main = entry_point("standardize", StandardizeConfig, lambda cfg: Standardizer(cfg).run())

if __name__ == "__main__":
    main()
