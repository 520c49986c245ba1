"""The capture contract (docs/concepts/hf-index.md) shared by every stage.

A captured layer is named by its *HF index* ``k``: its position in
``model(..., output_hidden_states=True).hidden_states``. ``k = 0`` is the embedding output,
``1 <= k <= N-1`` the output of decoder layer ``k-1``; ``k = N`` is the post-norm final state,
which no serving engine captures as an aux state, so it is never an aux index (it is stored on its
own as ``last_hidden``). Aux indices are stored ascending and unique, and concatenated in that
order, as every engine concatenates them.

The :class:`CaptureSpec` travels in every stage's ``manifest.json``; each stage compares the spec
it reads with the one it is asked for and refuses a mismatch, naming every field that differs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train import __version__
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, IncompleteError
from eagle3_train.core.fileio import atomic_write_json

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")  # the one list of dtypes a target runs or a state is stored in
STORAGES = ("dtype", "fp8")  # how shards store states: as computed, or e4m3 + scales (eagle3_train/core/storage.py)


def check_dtype(value: str, option: str = "dtype", auto: bool = False) -> None:
    """Refuse a ``dtype`` option that is not one of :data:`DTYPES` (or ``auto``, where allowed)."""
    allowed = ("auto", *DTYPES) if auto else DTYPES
    if value not in allowed:
        raise ConfigError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")


def check_storage(value: str, option: str = "storage") -> None:
    """Refuse a ``storage`` option that is not one of :data:`STORAGES`."""
    if value not in STORAGES:
        raise ConfigError(f"{option} must be one of {', '.join(STORAGES)}, got {value!r}")


def default_aux_indices(num_hidden_layers: int) -> tuple[int, ...]:
    """The capture every engine uses when given no ids: HF indices ``[2, N//2, N-3]``."""
    n = num_hidden_layers
    ks = (2, n // 2, n - 3)
    if not 2 < n // 2 < n - 3:
        raise ContractError(
            f"the default aux indices [2, N//2, N-3] = {list(ks)} are not three distinct layers "
            f"for a target with N={n} layers: pass aux indices explicitly"
        )
    return ks


def validate_aux_indices(indices: Any, num_hidden_layers: int) -> tuple[int, ...]:
    """Check that ``indices`` is a valid aux capture for a target with N layers; return a tuple.

    Valid: non-empty, integers, strictly ascending (hence unique), each ``0 <= k < N``.
    ``k = N`` is refused with its own reason: transformers returns the post-norm final state
    there, which no engine captures as an aux state.
    """
    n = num_hidden_layers
    try:
        ks = tuple(indices)
    except TypeError:
        raise ContractError(f"aux indices must be a list of HF indices, got {indices!r}") from None
    if not ks:
        raise ContractError("aux indices are empty: at least one layer must be captured")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ContractError(f"aux index {k!r} is not an integer (aux indices: {list(ks)})")
    for k in ks:
        if k == n:
            raise ContractError(
                f"aux index {k} = N is the post-norm final state (N={n} layers); no engine "
                f"captures it as an aux state. Valid aux indices are 0..{n - 1}"
            )
        if not 0 <= k < n:
            raise ContractError(
                f"aux index {k} is out of range for a target with N={n} layers; valid HF indices "
                f"are 0..{n - 1} (0 = embeddings, k = output of decoder layer k-1)"
            )
    if len(set(ks)) != len(ks):
        dup = sorted({k for k in ks if ks.count(k) > 1})
        raise ContractError(f"aux indices {list(ks)} repeat {dup}: each layer is captured once")
    if list(ks) != sorted(ks):
        raise ContractError(
            f"aux indices {list(ks)} are not ascending; engines concatenate in ascending layer "
            f"order, so write them as {sorted(ks)}"
        )
    return ks


@dataclass(frozen=True)
class TargetIdentity:
    """Which target produced or consumes the data.

    Args:
        path: how the user named the target (local dir, hub id, ``.gguf`` file, ``embedded``);
            informative only: the same weights at another path are the same target.
        model_type: the transformers ``model_type`` (selects the engine rules at export).
        config_hash: sha256 of the model config without volatile keys.
        tokenizer_hash: sha256 of the tokenizer's serialised form.
        chat_template_hash: sha256 of the chat template used to render conversations.
        chat_template_kwargs: the flags the template rendered them with (``enable_thinking``,
            ``thinking``, ``reasoning_effort``, ...), as engines pass ``chat_template_kwargs``;
            left out of :meth:`to_dict` when empty, so identities written before it existed and
            those without flags read and hash alike.
    """

    path: str
    model_type: str
    config_hash: str
    tokenizer_hash: str
    chat_template_hash: str
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["chat_template_kwargs"]:
            del d["chat_template_kwargs"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetIdentity:
        return cls(
            **{f: d[f] for f in cls.__dataclass_fields__ if f != "chat_template_kwargs"},
            chat_template_kwargs=dict(d.get("chat_template_kwargs") or {}),
        )


@dataclass(frozen=True)
class CaptureSpec:
    """What was captured from which target (docs/concepts/hf-index.md).

    Args:
        aux_indices: HF indices of the aux states, ascending and unique, each ``< N``.
        num_hidden_layers: N, the target's decoder layer count.
        hidden_size: the target's hidden size H.
        vocab_size: the target's vocabulary size.
        dtype: the dtype the target ran in, and the states are stored or read back in
            (``float32``, ``bfloat16``, ``float16``).
        target: the target's identity.
        storage: how the shards store the states (:data:`STORAGES`; ``fp8``: e4m3 with a scale
            per token and layer, eagle3_train/core/storage.py). Absent in specs written before it
            existed, which stored ``dtype``.
    """

    aux_indices: tuple[int, ...]
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    target: TargetIdentity
    storage: str = "dtype"

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_indices", validate_aux_indices(self.aux_indices, self.num_hidden_layers))
        if self.dtype not in DTYPES:
            raise ContractError(f"capture dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.storage not in STORAGES:
            raise ContractError(f"capture storage {self.storage!r} is not one of {list(STORAGES)}")
        for name in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ContractError(f"capture {name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_indices"] = list(self.aux_indices)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaptureSpec:
        missing = [f for f in cls.__dataclass_fields__ if f not in d and f != "storage"]
        if missing:
            raise BadInputError(f"capture spec lacks fields {missing}: {d}")
        return cls(
            aux_indices=tuple(d["aux_indices"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            hidden_size=int(d["hidden_size"]),
            vocab_size=int(d["vocab_size"]),
            dtype=str(d["dtype"]),
            target=TargetIdentity.from_dict(d["target"]),
            storage=str(d.get("storage", "dtype")),
        )


# Fields that name but do not define a target: a copy of the same weights elsewhere is the same.
INFORMATIVE_FIELDS = frozenset({"target.path"})


def differences(
    a: CaptureSpec | TargetIdentity | dict,
    b: CaptureSpec | TargetIdentity | dict,
    *,
    include_informative: bool = False,
) -> list[str]:
    """Every field in which ``a`` and ``b`` differ, as ``"field: a != b"`` lines.

    Nested fields are named with dots (``target.config_hash``). Fields in
    :data:`INFORMATIVE_FIELDS` are left out unless ``include_informative``.
    """
    da = a.to_dict() if hasattr(a, "to_dict") else dict(a)
    db = b.to_dict() if hasattr(b, "to_dict") else dict(b)
    prefix = "target." if isinstance(a, TargetIdentity) else ""
    out: list[str] = []
    _diff(da, db, prefix, out)
    if not include_informative:
        out = [line for line in out if line.split(":", 1)[0] not in INFORMATIVE_FIELDS]
    return out


def _diff(a: Any, b: Any, name: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{name}{key}.", out)
        return
    if a != b:
        out.append(f"{name.rstrip('.')}: {a!r} != {b!r}")


def write_manifest(directory: str | os.PathLike, stage: str, body: dict[str, Any], name: str = MANIFEST_NAME) -> Path:
    """Write ``<directory>/manifest.json`` (or ``name``) atomically; its presence marks the
    directory complete.

    ``stage``, ``format_version``, the package version and a UTC timestamp are added to ``body``.
    """
    path = Path(directory) / name
    manifest = {
        "stage": stage,
        "format_version": FORMAT_VERSION,
        "eagle3_train_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **body,
    }
    atomic_write_json(path, manifest)
    return path


def read_manifest(
    directory: str | os.PathLike, stage: str | None = None, name: str = MANIFEST_NAME, option: str | None = None
) -> dict[str, Any]:
    """Read ``<directory>/manifest.json`` (or ``name``); refuse a missing, unreadable or
    wrong-stage manifest. ``option``: the user's option that named ``directory`` (``data``), so the
    message says it as typed."""
    path = Path(directory) / name
    given = f"{option}={directory}" if option else str(directory)
    if not Path(directory).is_dir():
        raise IncompleteError(
            f"{given}: no such directory" if option else f"{directory} does not exist or is not a directory"
        )
    if not path.is_file():
        raise IncompleteError(
            f"{given} has no {name}: the stage writing it did not finish (or this is "
            f"not an eagle3_train directory); run that stage again to complete it"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or "stage" not in manifest:
        raise BadInputError(f"{path}: not an eagle3_train manifest (no 'stage' field)")
    if stage is not None and manifest["stage"] != stage:
        raise ContractError(f"{path}: expected the output of stage '{stage}', found stage '{manifest['stage']}'")
    version = manifest.get("format_version", 0)
    if version > FORMAT_VERSION:
        raise ContractError(
            f"{path}: format_version {version} is newer than this eagle3_train understands "
            f"({FORMAT_VERSION}); upgrade eagle3_train"
        )
    return manifest


# A training run (eagle3-train's out, eagle3-export's run): checkpoints/step<N>/ is finished once its
# state.json exists; best.json, written with checkpoint.keep_best, names the checkpoint whose evaluation
# had the best simulated acceptance length, which export then takes instead of the last.
BEST_FILE = "best.json"


def run_checkpoints(run: Path) -> list[Path]:
    """The run's finished checkpoints, oldest (lowest step) first."""
    root = run / "checkpoints"
    done = [p for p in root.glob("step*") if (p / "state.json").is_file()] if root.is_dir() else []
    return sorted(done, key=lambda p: int(p.name.removeprefix("step")))


def best_checkpoint(run: Path) -> Path | None:
    """The checkpoint ``best.json`` names (None without one); refuses one that is gone or unfinished."""
    path = run / BEST_FILE
    if not path.is_file():
        return None
    try:
        name = json.loads(path.read_text())["checkpoint"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BadInputError(f"{path}: not a best-checkpoint record ({e})") from None
    ckpt = run / "checkpoints" / name
    if not (ckpt / "state.json").is_file():
        raise BadInputError(f"{path} names {ckpt}, which is missing or unfinished; pass run=<a checkpoint directory>")
    return ckpt
