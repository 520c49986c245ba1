"""What each engine version computes for an EAGLE-3 draft's forward flags (docs/concepts/draft-head.md).

Our draft (:class:`eagle3_train.model.DraftConfig`) computes four flags that the engines read from
the draft's ``config.json``; EAGLE-3.1 heads set them. For each engine version one
:class:`DraftForward` row says, per flag, which keys it reads, which weight the flag adds, what it
does with that weight when the flag is off, and -- for a flag it never reads -- what it computes
instead. The rows live in each engine's module (``vllm.py``, ``sglang.py``); export writes the keys
they read, check refuses a head a named version would compute otherwise, and eval computes the head
as the version serves it (:meth:`DraftForward.flags`).

Where the flag meets the math (our module names; ``a`` the concatenated aux states, ``n`` of them):

- ``aux_norm`` (the engines' ``norm_before_fc``, weight ``input_norm``): ``a <- RMSNorm_{n*H_t}(a)``
  before ``fc``;
- ``fc_norm``: ``a <- cat_i RMSNorm_i(a_i)`` (one norm of width H_t per state, ``fc_norm.<i>``),
  after ``aux_norm`` when both are on;
- ``norm_before_residual``: the layer's residual is ``hidden_norm(h)`` instead of ``h``;
- ``norm_output``: chain step j >= 1 takes ``norm(out_{j-1})`` (the state the logits see) instead
  of the pre-norm ``out_{j-1}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# DraftConfig's fields the engines read from a draft's config.json, in the order messages name them
FLAG_NAMES = ("aux_norm", "fc_norm", "norm_before_residual", "norm_output")
# what each computes, for report lines
MEANING = {
    "aux_norm": "one RMSNorm over fc's input",
    "fc_norm": "one RMSNorm per aux state before fc",
    "norm_before_residual": "the layer's residual taken after hidden_norm",
    "norm_output": "each chain step fed the previous step's normed output",
}


@dataclass(frozen=True)
class Flags:
    """The forward variant an engine computes for a draft (:class:`eagle3_train.model.DraftConfig`'s
    fields of the same names)."""

    aux_norm: bool = False  # norm_before_fc: one RMSNorm (weight ``input_norm``) over the states before fc
    fc_norm: bool = False  # one RMSNorm per state before fc
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(h)
    norm_output: bool = False  # chain steps take norm(previous output)
    hidden_input_norm: bool = False  # the hidden half normed by input_layernorm, then hidden_norm (ModelOpt's training)

    def changed(self) -> list[str]:
        """The flags that are on, in field order."""
        return [f.name for f in fields(self) if getattr(self, f.name)]

    @classmethod
    def of(cls, source: Any) -> Flags:
        """The flags of a DraftConfig, or of a mapping holding some of them (absent: off)."""
        get = source.get if isinstance(source, Mapping) else lambda k, d: getattr(source, k, d)
        return cls(**{f.name: bool(get(f.name, False)) for f in fields(cls)})


@dataclass(frozen=True)
class FlagRead:
    """How one engine version reads one forward flag from a draft's ``config.json``.

    Args:
        keys: the key paths it reads, the first present wins; empty: it never reads the flag.
        weight: the weight the flag adds, as the engine loads it (``{i}``: one per aux state).
        unflagged: what it does with that weight when the flag is off: ``skips`` it or ``fails``.
        legacy: more top-level keys it takes as the flag when true (export does not write them).
        speculators_default: in a speculators config (top-level key only) the value when absent.
        source: the file and function that read and compute it.
        instead: for a flag it never reads, what it computes in its place.
    """

    keys: tuple[tuple[str, ...], ...]
    weight: str = ""
    unflagged: str = "skips"
    legacy: tuple[str, ...] = ()
    speculators_default: bool = False
    source: str = ""
    instead: str = ""

    @property
    def top_key(self) -> str | None:
        """The top-level key among ``keys`` (a speculators config has no ``eagle_config``)."""
        return next((path[0] for path in self.keys if len(path) == 1), None)

    def where(self) -> str:
        """The keys, for a message (``eagle_config.norm_before_fc or norm_before_fc``)."""
        return " or ".join(".".join(p) for p in self.keys) or "no key"

    def value(self, config: Mapping[str, Any], speculators: bool) -> bool:
        """The flag as this version computes it for ``config``."""
        if not self.keys:
            return False
        if speculators:  # vLLM's speculators reader copies the top-level key, with its own default
            return bool(config.get(self.top_key, self.speculators_default)) if self.top_key else False
        found = False
        for path in self.keys:
            node: Any = config
            for key in path:
                node = node.get(key) if isinstance(node, Mapping) and key in node else _ABSENT
            if node is not _ABSENT:
                found = bool(node)
                break
        return found or any(bool(config.get(k)) for k in self.legacy)  # SGLang: `fc_norm or use_aux_norm`


_ABSENT = object()


@dataclass(frozen=True)
class DraftForward:
    """One engine version's reading of a draft's forward flags (one row per version read).

    Args:
        engine: the engine's registry name.
        version: the release read.
        reads: flag (:data:`FLAG_NAMES`) -> how it reads it.
        loads_speculators: it loads a speculators export (``speculators_model_type``).
        window_from_config: it attends within the draft config's sliding window (``layer_types``
            ``sliding_attention`` and ``sliding_window``); else only a server option sets one.
        source: the file the row was read from.
    """

    engine: str
    version: str
    reads: Mapping[str, FlagRead]
    loads_speculators: bool
    window_from_config: bool
    source: str

    def __post_init__(self) -> None:
        if set(self.reads) != set(FLAG_NAMES):
            raise ValueError(f"{self.engine} {self.version}: reads must name exactly {FLAG_NAMES}")

    @property
    def name(self) -> str:
        """``sglang 0.5.17``, for messages."""
        return f"{self.engine} {self.version}"

    def flags(self, config: Mapping[str, Any], speculators: bool = False) -> Flags:
        """The forward this version computes for a draft whose config.json is ``config``."""
        return Flags(**{flag: read.value(config, speculators) for flag, read in self.reads.items()})

    def ignored(self) -> list[str]:
        """The flags it never reads."""
        return [flag for flag in FLAG_NAMES if not self.reads[flag].keys]

    def refusal(self, trained: Flags, config: Mapping[str, Any], speculators: bool = False) -> list[str]:
        """Why this version would serve a head trained with ``trained`` otherwise, one line per flag
        (empty: it computes the head as trained)."""
        served, out = self.flags(config, speculators), []
        for flag in FLAG_NAMES:
            read, want, got = self.reads[flag], getattr(trained, flag), getattr(served, flag)
            if want == got:
                continue
            if not read.keys:
                out.append(f"{self.name} ignores {flag}: {read.instead} ({read.source})")
            elif want:
                out.append(
                    f"{self.name} reads {flag} from {read.where()}, which config.json does not set: it would serve "
                    f"this head without it"
                )
            else:
                out.append(f"{self.name} computes {flag} ({read.where()} is set), which the head was not trained with")
        return out

    def weight_names(self, flags: Flags, num_aux: int) -> dict[str, str]:
        """{our weight name: the name this version loads} for the norms ``flags`` add."""
        out = {}
        for flag in FLAG_NAMES:
            weight = self.reads[flag].weight
            if not getattr(flags, flag) or not weight:
                continue
            for i in range(num_aux) if "{i}" in weight else [None]:
                out[our_weight(flag, i)] = weight.format(i=i)
        return out


def our_weight(flag: str, i: int | None = None) -> str:
    """The weight name of a flag's norm in :class:`eagle3_train.model.Eagle3Draft`."""
    return f"{flag}.weight" if i is None else f"{flag}.{i}.weight"


def flag_keys(flags: Flags, rows: Iterable[DraftForward]) -> tuple[dict[tuple[str, ...], bool], list[str]]:
    """The config.json entries that make every version of ``rows`` compute the flags that are on
    in ``flags`` (every key path each reads, so that a reader that looks in one place only finds
    them), and why a version cannot: it never reads a flag."""
    entries: dict[tuple[str, ...], bool] = {}
    problems: list[str] = []
    for row in rows:
        for flag in flags.changed():
            if flag not in FLAG_NAMES:  # a training-only variant no engine computes
                problems.append(f"{row.name} has no {flag}: no engine computes it")
                continue
            read = row.reads[flag]
            if not read.keys:
                problems.append(f"{row.name} ignores {flag}: {read.instead} ({read.source})")
            entries.update(dict.fromkeys(read.keys, True))
    return entries, problems
