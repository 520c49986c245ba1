"""The dump stage, whichever backend produces the states.

What it owns: the prepared data and the target's identity (the tokenizer must match), the capture
(HF indices to store), claiming the output directory (eagle3_train.core.stagedir: a partial dump made for
another request is refused, never mixed), resuming (the unit of work is the sample: finished
shards are scanned for their sample ids, leftovers of a crash are deleted, the rest is done again),
the shard writer, coverage (every sample stored exactly once) and the manifest, written last.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.dump.backend import Backend, make_backend
from data_prep.dump.config import DumpConfig, stored_indices
from data_prep.dump.writer import ShardWriter
from eagle3_train.core.cli import config_dict
from eagle3_train.core.contract import MANIFEST_NAME, CaptureSpec, read_manifest
from eagle3_train.core.dist import all_gather_objects, barrier
from eagle3_train.core.errors import Eagle3Error, IncompleteError, Interrupted
from eagle3_train.core.fileio import remove_temporaries
from eagle3_train.core.formats import ShardRecord, finished_records, read_keys, remove_unfinished, verify_shard
from eagle3_train.core.log import EVERY_RANK, progress_bar
from eagle3_train.core.prepared import PreparedData
from eagle3_train.core.stagedir import LOCK_NAME, StageDir, hold_lock
from eagle3_train.core.storage import bytes_per_token, layout
from eagle3_train.engines.rules import serving_warning
from eagle3_train.targets import load_target, resolve_dtype

logger = logging.getLogger(__name__)

STAGE = "dump"


class Dumper:
    """The dump stage on this process (see the module docstring).

    Args:
        cfg: the dump's options.
        backend: what produces the states; None: the one ``cfg.backend`` names.
    """

    def __init__(self, cfg: DumpConfig, backend: Backend | None = None):
        assert cfg.out is not None and cfg.data is not None  # DumpConfig requires both to dump
        self.cfg = cfg
        self.backend = backend or make_backend(cfg)
        self.out = Path(cfg.out).expanduser()
        self.shard_dir = self.out / "shards"
        self.team = self.backend.team()
        self.dist = self.team.dist
        self.backend.resolve_dtype(self.dist)
        data = PreparedData(cfg.data, "data")
        self.prepared_dir, self.prepared, self.dataset, self.sample_ids = (
            data.path,
            data.manifest,
            data.dataset,
            data.sample_ids,
        )
        # config and tokenizer only: a backend that runs the target loads its weights once there is work
        self.target = load_target(
            cfg.target, cache_dir=cfg.cache_dir, load_model=False, trust_remote_code=cfg.trust_remote_code
        )
        self.identity = data.identity_for(self.target, cfg.target)
        aux, self.stored = stored_indices(cfg.capture, self.target.num_hidden_layers)
        self.spec = CaptureSpec(
            aux,
            self.target.num_hidden_layers,
            self.target.hidden_size,
            self.target.vocab_size,
            cfg.dtype,
            self.identity,
            cfg.storage,
        )
        self.request = {
            "capture": self.spec.to_dict(),
            "stored_indices": self.stored,
            "prepared_fingerprint": self.prepared["fingerprint"],
            "backend": cfg.backend,
        }
        self.dir = StageDir(self.out, STAGE, self.request)
        self.backend.check(self)
        warning = serving_warning(list(aux), self.identity.model_type, self.target.num_hidden_layers)
        if warning:
            self.say(f"warning: {warning}", logging.WARNING)

    def say(self, text: str, level: int = logging.INFO) -> None:
        """A message: once for a process group (rank 0), from every independent client (named)."""
        if self.team.group:
            if self.dist.is_main:
                logger.log(level, text)
        else:
            logger.log(level, f"eagle3-dump [client {self.dist.rank}/{self.dist.world_size}]: {text}", extra=EVERY_RANK)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Dump what is missing; return the manifest, or None when other clients still work."""
        if (manifest := self._finished()) is not None:
            return manifest
        self._claim()
        todo = self._todo()
        start = time.time()
        try:
            written, tokens = self.backend.dump(self, todo)
        except KeyboardInterrupt:
            kept = len(list(self.shard_dir.glob("*.json")))
            raise Interrupted(
                f"the dump stopped; {kept} finished shards are kept under {self.shard_dir} and are not dumped again"
            ) from None
        return self._finish(time.time() - start, written, tokens)

    def _finished(self) -> dict[str, Any] | None:
        """The manifest of a finished dump of this very request (another request is refused)."""
        manifest = self.dir.finished()
        if manifest is not None:
            logger.info(f"eagle3-dump: {self.out} is already complete with this capture; nothing to do")
        return manifest

    def _claim(self) -> None:
        """Record the request (or check it against a partial dump's) and delete crash leftovers:
        in a process group rank 0 does it for all, then every rank proceeds; an independent client
        clears only its own files, as the others may be writing right now."""
        if self.team.group and not self.dist.is_main:
            barrier()
            return
        # one launch at a time (one process per client: clients share the directory by design)
        self.out.mkdir(parents=True, exist_ok=True)
        hold_lock(self.out, "dump", LOCK_NAME if self.team.group else f".eagle3-client{self.dist.rank:05d}.lock")
        self.dir.claim()
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        removed = remove_unfinished(self.shard_dir, "" if self.team.group else self.shard_prefix())
        if self.team.group:  # the only writer of the directory (clients share it, and only clear their own)
            removed += remove_temporaries(self.out)
        if removed:
            self.say(f"removed {len(removed)} unfinished files of an interrupted run")
        if self.team.group:
            barrier()

    def _todo(self) -> np.ndarray:
        """Rows whose samples are not yet stored (nor recorded as non-finite) by a finished shard."""
        done: set[int] = set()
        for rec in finished_records(self.shard_dir):
            done.update(read_keys(self.shard_dir / f"{rec.name}.safetensors", ("sample_ids",))["sample_ids"].tolist())
            done.update(rec.extra.get("nonfinite_sample_ids", []))
        todo = np.nonzero(~np.isin(self.sample_ids, np.fromiter(done, dtype=np.int64, count=len(done))))[0]
        if done:
            self.say(f"resuming: {len(done)} samples already stored, {len(todo)} to go")
        if self.team.group:
            barrier()  # every rank has planned from the same shards before any rank writes one
        return todo

    def shard_prefix(self) -> str:
        """The start of this process's shard names (the rest is random and a count)."""
        return f"{self.dist.rank:05d}-"

    def state_keys(self) -> list[str]:
        """The per-token states a shard holds."""
        return [f"hidden.{k}" for k in self.stored] + ["last_hidden"]

    def shapes(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """Every per-token tensor of a shard: key -> (dtype, one token's shape); fp8 storage adds
        each state's ``.scale``."""
        return layout(
            self.state_keys(), self.spec.hidden_size, resolve_dtype(self.cfg.dtype, "cuda"), self.spec.storage
        )

    def writer(self) -> ShardWriter:
        """A shard writer for this process; its shards are named ``<rank>-<random>-<count>``."""
        per_token = bytes_per_token(self.shapes())
        longest = int(self.dataset["num_tokens"][:].max())
        return ShardWriter(
            self.shard_dir,
            f"{self.shard_prefix()}{secrets.token_hex(4)}",
            self.state_keys(),
            self.spec.hidden_size,
            resolve_dtype(self.cfg.dtype, "cuda"),
            self.spec.storage,
            shard_tokens=max(1, int(self.cfg.shard_size_mb * 2**20) // per_token),
            max_batch_tokens=max(self.cfg.max_tokens_per_batch, longest),
            threads=self.cfg.writer_threads,
            device=self.dist.device,
        )

    def _finish(self, elapsed: float, written: int, tokens: int) -> dict[str, Any] | None:
        """In a process group: once every rank is done, rank 0 writes the manifest. An independent
        client writes it if every sample is stored, else leaves that to the last one."""
        if self.team.group:
            totals = [sum(v) for v in zip(*all_gather_objects([written, tokens]))]
            barrier()
            manifest = self._finalize(elapsed, totals) if self.dist.is_main else None
            barrier()
            return manifest
        missing = self._coverage()[3]
        if len(missing):
            self.say(
                f"my share is done; {len(missing)} samples of other clients are still missing. The last client to "
                f"finish writes {MANIFEST_NAME} (or run this command again once all are done)"
            )
            return None
        remove_unfinished(self.shard_dir)  # every sample is stored: nobody is writing any more
        return self._finalize(elapsed, [written, tokens])

    def _coverage(self) -> tuple[list[ShardRecord], np.ndarray, list[int], np.ndarray]:
        """The finished shards, the sample ids they store, those dropped as non-finite, and the
        sample ids still missing; a sample stored twice is an error."""
        records = finished_records(self.shard_dir)
        stored: list[np.ndarray] = []
        nonfinite: list[int] = []
        for rec in records:
            stored.append(read_keys(self.shard_dir / f"{rec.name}.safetensors", ("sample_ids",))["sample_ids"].numpy())
            nonfinite += rec.extra.get("nonfinite_sample_ids", [])
        ids = np.concatenate(stored) if stored else np.zeros(0, dtype=np.int64)
        uniq, counts = np.unique(np.concatenate([ids, np.asarray(nonfinite, dtype=np.int64)]), return_counts=True)
        if (counts > 1).any():
            raise Eagle3Error(f"{self.shard_dir}: samples stored twice: {uniq[counts > 1][:10].tolist()}")
        return records, ids, nonfinite, np.setdiff1d(self.sample_ids, uniq)

    def _finalize(self, elapsed: float, totals: list[int]) -> dict[str, Any]:
        """After every process finished: check coverage, then write the manifest."""
        records, ids, nonfinite, missing = self._coverage()
        if len(missing):
            raise IncompleteError(
                f"{self.shard_dir}: {len(missing)} samples are missing (e.g. {missing[:10].tolist()}); "
                f"run the same command again to finish"
            )
        tokens = sum(r.num_tokens for r in records)
        total_bytes = sum(r.bytes for r in records)
        body = {
            "capture": self.spec.to_dict(),
            "stored_indices": self.stored,
            "keys": list(self.shapes()),
            "target": self.identity.to_dict(),
            "prepared": {"path": str(self.prepared_dir.resolve()), "fingerprint": self.prepared["fingerprint"]},
            "config": config_dict(self.cfg),
            "shards": [r.to_dict() for r in records],
            "counts": {
                "samples": int(len(ids)),
                "tokens": tokens,
                "bytes": total_bytes,
                "bytes_per_token": total_bytes / max(tokens, 1),
                "nonfinite_samples": len(nonfinite),
            },
            "nonfinite_sample_ids": sorted(nonfinite),
            "run": self.backend.run_info(self)
            | {"seconds": round(elapsed, 3), "tokens_this_run": totals[1], "bytes_this_run": totals[0]},
        }
        manifest = self.dir.write_manifest(body)
        rate = totals[1] / max(elapsed, 1e-9)
        logger.info(
            f"eagle3-dump: {len(ids)} samples, {tokens} tokens, {total_bytes / 2**30:.2f} GiB in "
            f"{len(records)} shards -> {self.out}\n"
            f"  this run: {totals[1]} tokens in {elapsed:.1f} s ({rate:.0f} tok/s); "
            f"{len(nonfinite)} samples dropped for non-finite states"
        )
        return manifest

    def progress(self, rows: Any, desc: str) -> Any:
        """A progress bar over the tokens of ``rows`` (shown on rank 0 of a group, by every client)."""
        total = int(self.dataset["num_tokens"][:][np.asarray(rows, dtype=np.int64)].sum()) if len(rows) else 0
        show = self.cfg.progress if self.dist.is_main or not self.team.group else False
        return progress_bar(
            total=total, unit="tok", unit_scale=True, desc=desc, show=show, every_rank=not self.team.group
        )


def verify(out: str | os.PathLike, progress: bool | None = None) -> list[str]:
    """Re-read every shard of a finished dump; return the problems found, by shard name.
    ``progress``: the command's option (:func:`eagle3_train.core.log.progress_bar`)."""
    out = Path(out).expanduser()
    manifest = read_manifest(out, STAGE)
    problems: list[str] = []
    records = [ShardRecord.from_dict(r) for r in manifest["shards"]]
    for rec in progress_bar(records, desc="verify", unit="shard", show=progress):
        problems += verify_shard(out / "shards", rec)
    listed = {f"{r.name}.safetensors" for r in records}
    for extra in sorted(p.name for p in (out / "shards").glob("*.safetensors")):
        if extra not in listed:
            problems.append(f"{extra}: not listed in the manifest")
    return problems
