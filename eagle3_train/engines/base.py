"""The interface every engine module fills (docs/concepts/engines.md), and what the engines share.

One module per engine (``sglang.py``, ``vllm.py``, ``trtllm.py``; ``hf.py`` for transformers run in
this process) builds one :class:`Engine`, and the registry (:mod:`eagle3_train.engines.registry`)
maps its name to it. Every consumer asks the registry: export, check, eval, the served dump, served
regeneration, served acceptance. An engine holds:

- its layer-id rules as data (:class:`Rule` rows: where it reads a draft's ids, which HF indices
  (docs/concepts/hf-index.md) it captures for them, the versions each row was read from), the
  targets it refuses, and the runs that verified a rule; the pure queries :meth:`Engine.resolve`
  ("what does it capture given this config") and :meth:`Engine.ids_for` ("what must the config
  say so that it captures these HF indices");
- its command line (:class:`Command`: the flags its CLI takes) and the command that serves a
  target with a draft;
- its hidden-state capture for the served dump (:class:`eagle3_train.engines.capture.StateCapture`);
- its generation API for served regeneration (:class:`Generation`);
- where it counts its speculative decoding, for served acceptance (:class:`SpecMetrics`).

Engines capture residual streams, never a normed state: an id that lands on N is the last layer's
output *before* the final norm, which no HF index names (HF index N is the post-norm state);
:meth:`Engine.resolve` reports it as ``pre_norm_final``, never as HF index N. With no ids where it
reads them, every engine captures the default HF indices ``[2, N//2, N-3]``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3_train.core import families
from eagle3_train.core.errors import ContractError
from eagle3_train.engines.heads import DraftForward, Flags

if TYPE_CHECKING:  # its own module: it imports torch
    from eagle3_train.engines.capture import StateCapture

# Where the engines read a draft's layer ids in its config.json (key paths). The top-level key also
# carries, in every export, the trained HF indices themselves (eagle3_train.serving.export).
TOP_KEY = "eagle_aux_hidden_state_layer_ids"
NESTED = ("eagle_config", "eagle_aux_hidden_state_layer_ids")
NESTED_V2 = ("eagle_config", "layer_ids")

# Target model_type -> the family whose engine code serves it (a rule names a family, or ``*``): the
# family table's (eagle3_train/core/families.py) engine_code column.
FAMILIES = {f.model_type: f.engine_code for f in families.FAMILIES}


class Unexpressible(ContractError):
    """An engine cannot be told to capture these HF indices."""


def family_of(model_type: str) -> str | None:
    """The family whose engine code serves ``model_type`` (None: no engine's code for it was read)."""
    return FAMILIES.get(model_type)


def engine_default(num_hidden_layers: int) -> list[int]:
    """What engines capture with no ids: [2, N//2, N-3], computed as they do (unchecked, so a
    shallow target gives what the engine would really take)."""
    n = num_hidden_layers
    return sorted([2, n // 2, n - 3])


def plus_one(ids: list[int], n: int) -> list[int]:
    """Id v captures HF index v+1 (the id counts decoder layers from 0; HF index 0 is the embeddings)."""
    return [v + 1 for v in ids]


def identity(ids: list[int], n: int) -> list[int]:
    """Id v captures HF index v."""
    return list(ids)


@dataclass(frozen=True)
class Rule:
    """How one engine runner reads the ids for one target family.

    Args:
        versions: the engine versions the rule was read from (and which runner).
        family: a value of :data:`FAMILIES`, or ``*`` for every family.
        keys: where the ids are read, in order (the first present wins); each a key path.
        to_hf: config ids -> captured HF indices, given N (a result N is the pre-norm final state).
        note: what to tell the user about this engine.
        model_types: the target model_types the engine serves with this rule (None: every one of
            the family); for another the engine refuses the target.
        id0: why id 0 (the embeddings) fails in this engine ("": it does not).
        id0_is_final: id 0 runs but feeds, in its slot, the last layer's output before the final
            norm (the residual buffer the captured embedding tensor became); else id 0 crashes.
        unwritable: what to tell a user whose capture this rule cannot write ("": the general hint).
    """

    versions: str
    family: str
    keys: tuple[tuple[str, ...], ...]
    to_hf: Callable[[list[int], int], list[int]]
    note: str = ""
    model_types: frozenset[str] | None = None
    id0: str = ""
    id0_is_final: bool = False
    unwritable: str = ""

    @property
    def min_id(self) -> int:
        """The smallest id for which the engine captures what the id names."""
        return 1 if self.id0 else 0

    def applies(self, model_type: str) -> bool:
        """Whether the rule covers a target of ``model_type``."""
        return self.family in ("*", family_of(model_type)) and (
            self.model_types is None or model_type in self.model_types
        )


@dataclass
class Resolution:
    """What one engine runner captures for a config.

    Args:
        rule: the runner's rule.
        ids: what it read (None: nothing, so the default).
        source: the key path it read, or "default".
        hf_indices: the HF indices it captures (ascending), never N.
        pre_norm_final: it also captures the last layer's output before the final norm (an id
            landing on N, or vLLM's id 0), which no HF index names.
        problem: why the engine fails on these ids (None: it runs).
        fed: the states it concatenates, in its order: HF indices, N for the pre-norm final state.
        note: what it does with these ids that the config does not say (None: nothing).
    """

    rule: Rule
    ids: list[int] | None
    source: str
    hf_indices: list[int]
    pre_norm_final: bool = False
    problem: str | None = None
    fed: list[int] = field(default_factory=list)
    note: str | None = None

    def describe(self) -> str:
        """``HF [..]`` (+ the pre-norm final state), for a report line."""
        return f"HF {self.hf_indices}" + (" + the pre-norm final state (no HF index)" if self.pre_norm_final else "")


# ---- the command line ----------------------------------------------------------------------------

FLAG_KINDS = ("switch", "value", "int", "ints", "json")


@dataclass(frozen=True)
class Command:
    """An engine's command line: the words that start it and the flags its CLI takes.

    Every command this project prints or writes for the engine (the dump's launch commands, the
    model card's serve commands, served acceptance's hint) is built from these flags, and the tests
    parse each one back with :meth:`parse`, so a flag the engine does not have cannot slip in.

    Args:
        program: the words before the arguments (``("vllm", "serve")``).
        positional: the names of the positional arguments after them (``("model",)``).
        flags: flag -> what it takes (one of :data:`FLAG_KINDS`): ``switch`` nothing, ``value`` one
            word, ``int`` one integer, ``ints`` one or more integers, ``json`` one JSON word.
        read_from: the engine version and the file its CLI was read from.
    """

    program: tuple[str, ...]
    positional: tuple[str, ...]
    flags: Mapping[str, str]
    read_from: str

    def __post_init__(self) -> None:
        bad = {f: k for f, k in self.flags.items() if k not in FLAG_KINDS or not f.startswith("--")}
        if bad:
            raise ValueError(f"flags {bad}: each must be --name and take one of {FLAG_KINDS}")

    def line(self, *positional: str, **flags: Any) -> list[str]:
        """The argv: the program, ``positional``, then ``flags`` (``--flag-name`` from ``flag_name``;
        True: a switch, a list: integers, a dict: JSON). Refuses a flag the CLI does not take."""
        argv = [*self.program, *positional]
        for name, value in flags.items():
            flag = "--" + name.replace("_", "-")
            kind = self.flags.get(flag)
            if kind is None:
                raise ValueError(f"{flag} is not a flag of {' '.join(self.program)} ({self.read_from})")
            if kind == "switch":
                argv.append(flag)
            elif kind == "ints":
                argv += [flag, *map(str, value)]
            elif kind == "json":
                argv += [flag, json.dumps(value, separators=(",", ":"))]
            else:
                argv += [flag, str(value)]
        return argv

    def parse(self, argv: list[str]) -> dict[str, Any]:
        """A command line back into {positional name or flag: value}; raises ``ValueError``
        naming the first word that is not this engine's (another program, an unknown flag, a
        value of the wrong kind)."""
        n = len(self.program)
        if tuple(argv[:n]) != self.program:
            raise ValueError(f"{shlex.join(argv[:n])!r} does not start {' '.join(self.program)}")
        out: dict[str, Any] = dict(zip(self.positional, argv[n : n + len(self.positional)]))
        if len(out) < len(self.positional):
            raise ValueError(f"{' '.join(self.program)} needs {list(self.positional)}")
        rest = argv[n + len(self.positional) :]
        i = 0
        while i < len(rest):
            flag, _, inline = rest[i].partition("=")
            kind = self.flags.get(flag)
            if kind is None:
                raise ValueError(f"{rest[i]!r} is not a flag of {' '.join(self.program)} ({self.read_from})")
            i += 1
            if kind == "switch":
                out[flag] = True
                continue
            if kind == "ints":
                words = []
                while i < len(rest) and not rest[i].startswith("--"):
                    words.append(rest[i])
                    i += 1
            else:
                words = [inline] if inline else rest[i : i + 1]
                i += 0 if inline else 1
            if not words:
                raise ValueError(f"{flag} takes a value")
            try:
                out[flag] = (
                    json.loads(words[0])
                    if kind == "json"
                    else [int(w) for w in words]
                    if kind == "ints"
                    else int(words[0])
                    if kind == "int"
                    else words[0]
                )
            except ValueError:
                raise ValueError(f"{flag} takes {kind}, got {words}") from None
        return out


def shell(argv: list[str], breaks: tuple[str, ...] = (), extra: str = "") -> str:
    """``argv`` as one shell command (quoted), continued on a new line before each flag of
    ``breaks``; ``extra`` (flags the user wrote, already shell words) goes last as it is."""
    text = " ".join(f"\\\n  {w}" if w in breaks else shlex.quote(w) for w in argv)  # a flag needs no quotes
    return text + (f" {extra}" if extra else "")


# ---- served regeneration and served acceptance ---------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """One engine's generation endpoint, for regeneration through it (data_prep/served_regen.py).

    Args:
        path: the endpoint under the server's URL.
        names_model: the request names the served model (vLLM's OpenAI server routes by it).
        request: (prompt ids, model, sampling, eos ids, seed) -> the JSON body.
        reply: (response, where) -> (generated ids, finish reason, the stop token it matched).
        read_from: the engine version and the files the API was read from.
    """

    path: str
    names_model: bool
    request: Callable[[list[int], str | None, dict, list[int], int | None], dict]
    reply: Callable[[dict, str], tuple[list[int], str | None, Any]]
    read_from: str


def sampling_fields(sampling: dict) -> dict[str, Any]:
    """Sampling fields the engines name alike. All are sent: a field left out takes the server's
    default, which may come from the target's generation_config (top_k, repetition penalty)."""
    greedy = not sampling["do_sample"]
    return {
        "temperature": 0.0 if greedy else float(sampling["temperature"]),
        "top_p": 1.0 if greedy else float(sampling["top_p"]),
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }


@dataclass(frozen=True)
class SpecMetrics:
    """Where one engine counts its speculative decoding, for served acceptance
    (eagle3_train/evaluation/served_acceptance.py): Prometheus counters of its ``/metrics``, named
    as registered (the text format adds ``_total`` to a counter's sample; both spellings are read).

    Args:
        engine: as in ``engine=``.
        read_from: the engine version and the files the names were read from.
        drafts: verify steps that carried draft tokens, over all requests.
        draft_tokens: draft tokens proposed.
        accepted: draft tokens accepted.
        accepted_per_position: drafts whose tokens up to this position were all accepted, one
            sample per value of ``position_label`` (0-based).
        position_label: the label naming the draft position.
        requests: finished requests (to see other clients' traffic).
        generation_tokens: generated tokens (likewise).
        enable: how to start the engine so that it speculates, for the error message.
        per_reply: the figures come in each reply's ``meta_info`` (the names are its keys;
            ``accepted_per_position`` a histogram of accepted drafts per step), not from ``/metrics``.
        ids_route: where ``template=client`` sends token ids (``/v1/completions``, OpenAI's, or
            ``/generate``, SGLang's own).
    """

    engine: str
    read_from: str
    drafts: str
    draft_tokens: str
    accepted: str
    accepted_per_position: str
    position_label: str
    requests: str
    generation_tokens: str
    enable: str
    per_reply: bool = False
    ids_route: str = "/v1/completions"


# ---- the engine ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """One engine (or transformers run in this process): everything the project knows about it.

    Args:
        name: as in ``engine=``, ``engines=[...]``, ``backend=`` and ``regen.backend=``.
        title: how messages name it (``vLLM``).
        version: the release whose source its rules were read from.
        rules: its layer-id rules, the default runner's first (empty: it serves no draft).
        verified: target model_type -> the real run that confirmed its rule (version, machine,
            date and results file); every other model_type's rule was read from source only.
        serves: the target model_types it runs EAGLE-3 drafts for at all, when it refuses every
            other at load (None: a model_type no rule covers is merely one whose code was not read).
        serves_note: what that refusal is, for the message.
        exports: it reads the ids from the draft's ``config.json``: export writes its keys and
            checks by default for it, eval takes its rule.
        forwards: what it computes for a draft's forward flags, one row per version read, the
            release this project serves with first (empty: it serves no draft, or none was read).
        skips_fc: it applies ``fc`` only when the captured width differs from the draft's hidden size.
        foreign_weights: what it does with a weight its draft class lacks, for export's refusal.
        in_process: it runs the target in this process (transformers): no server to start.
        command: its command line (None: none).
        serve: (target, draft, num_speculative_tokens, more flags) -> the argv that serves the
            target with the draft (a draft of None: the target alone), built by ``command`` (None:
            it serves no draft).
        version_route: (GET path, JSON key) where a running server says its version.
        capture: its hidden-state capture for the served dump (None: it has none).
        generation: its generation endpoint for served regeneration (None: none).
        metrics: where it counts its speculative decoding, for served acceptance (None: unknown).
        draft_dtype_own: non-empty where, under ``--dtype auto``, it runs the draft in the dtype the
            draft's own config names rather than the target's, and what a difference then does;
            eagle3-bench then passes the draft's dtype to both engines it starts.
        attention_planned_by_target: non-empty where it plans the draft's attention kernels with the
            target's head counts and head size, so a draft whose attention is shaped otherwise can
            fail at start; what happens then and what to do.
    """

    name: str
    title: str
    version: str
    rules: tuple[Rule, ...] = ()
    verified: Mapping[str, str] = field(default_factory=dict)
    serves: frozenset[str] | None = None
    serves_note: str = ""
    exports: bool = False
    forwards: tuple[DraftForward, ...] = ()
    skips_fc: bool = False
    foreign_weights: str = ""
    in_process: bool = False
    command: Command | None = None
    serve: Callable[[str, str | None, int, dict[str, Any]], list[str]] | None = None
    version_route: tuple[str, str] | None = None
    capture: StateCapture | None = None
    generation: Generation | None = None
    metrics: SpecMetrics | None = None
    draft_dtype_own: str = ""
    attention_planned_by_target: str = ""

    @property
    def roles(self) -> frozenset[str]:
        """What the project uses it for: ``rules`` (check), ``export`` (export, eval), ``dump``
        (``backend=``), ``regenerate`` (``regen.backend=``), ``acceptance`` (served acceptance),
        ``bench`` (eagle3-bench: started with and without a draft, its figures read)."""
        has = {
            "rules": bool(self.rules),
            "export": self.exports,
            "dump": self.in_process or self.capture is not None,
            "regenerate": self.in_process or self.generation is not None,
            "acceptance": self.metrics is not None,
            "bench": self.metrics is not None and self.serve is not None and self.version_route is not None,
        }
        return frozenset(role for role, yes in has.items() if yes)

    # -- the layer-id rules: pure queries ------------------------------------------------------

    def rules_for(self, model_type: str) -> list[Rule]:
        """The rules that apply to a target of ``model_type`` (several runners may; the default
        runner first); none: the engine does not serve EAGLE-3 for it."""
        return [r for r in self.rules if r.applies(model_type)]

    def unserved(self, model_type: str) -> str:
        """Why no config can make this engine serve a draft for a ``model_type`` target."""
        if self.serves is not None and model_type not in self.serves:
            return f"{self.name} {self.version} {self.serves_note} ({sorted(self.serves)}); it refuses model_type {model_type!r} at load"
        known = sorted(m for m in set(FAMILIES) | (self.serves or set()) if self.rules_for(m))
        return (
            f"{self.name}: no rule covers target model_type {model_type!r} (known for {self.name}: {known}); its "
            f"behaviour is unknown, so no config can be promised to work"
        )

    def verification(self, model_type: str) -> str:
        """How this project knows the rule for ``model_type``: a real run (which), the engine's
        source only (which versions), or no rule at all."""
        if model_type in self.verified:
            return f"verified by a run: {self.verified[model_type]}"
        rules = self.rules_for(model_type)
        if not rules:
            return "no rule: the engine serves no EAGLE-3 draft for it, or its code was not read"
        return "read from source only: " + "; ".join(sorted({f"{self.name} {r.versions}" for r in rules}))

    def resolve(self, config: dict, model_type: str, num_hidden_layers: int) -> list[Resolution]:
        """What each runner captures given the draft's ``config`` (default runner first); empty
        when the engine does not serve EAGLE-3 for ``model_type``."""
        n = num_hidden_layers
        out = []
        for rule in self.rules_for(model_type):
            for path in rule.keys:
                ids = lookup(config, path)
                if ids is not None:
                    ids, source = list(ids), ".".join(path)
                    break
            else:
                ids, source = None, "default"
            fed = sorted(rule.to_hf(ids, n)) if ids is not None else engine_default(n)
            problem = note = None
            if ids is not None and ids and min(ids) < rule.min_id:
                why = rule.id0 if min(ids) == 0 else f"ids below {rule.min_id} are outside its rule"
                text = f"{self.name} {rule.versions} cannot use id {min(ids)} for a {model_type} target: {why}"
                if rule.id0_is_final and min(ids) == 0:  # it runs, on the pre-norm final state in id 0's slot
                    fed, note = [n] + [k for k in fed if k != 0], text
                else:
                    problem = text
            out.append(Resolution(rule, ids, source, sorted(k for k in fed if k != n), n in fed, problem, fed, note))
        return out

    def ids_for(
        self, hf_indices: list[int], model_type: str, num_hidden_layers: int
    ) -> dict[tuple[str, ...], list[int]]:
        """The config entries that make this engine capture ``hf_indices``: {key path: ids}.

        Raises :class:`Unexpressible` naming the engine, the family and what would work instead.
        """
        n, ks = num_hidden_layers, list(hf_indices)
        rules = self.rules_for(model_type)
        if not rules:
            raise Unexpressible(self.unserved(model_type))
        out: dict[tuple[str, ...], list[int]] = {}
        for rule in rules:
            candidates = [ks, [k - 1 for k in ks]]  # the only shapes the engines' rules take
            good = [v for v in candidates if min(v) >= rule.min_id and sorted(rule.to_hf(v, n)) == ks]
            if not good:
                raise Unexpressible(self._why(model_type, rule, ks, n))
            out.setdefault(rule.keys[0], good[0])
        return out

    def _why(self, model_type: str, rule: Rule, ks: list[int], n: int) -> str:
        below = [k - 1 for k in ks]
        if 0 in ks and sorted(rule.to_hf(below, n)) == ks:  # the id that would name HF index 0 is -1
            hint = "HF index 0 (the embeddings) cannot be captured: its id would be -1; choose aux layers >= 1"
        elif 0 in ks and rule.min_id > 0:
            hint = f"HF index 0 (the embeddings) cannot be captured: {rule.id0}; choose aux layers >= 1"
        else:
            hint = rule.unwritable or "choose other aux layers, or another engine"
        family = family_of(model_type) or model_type
        return (
            f"{self.name} ({rule.versions}, {family} family, {rule.note}) cannot capture HF indices {ks} (N={n}): "
            f"{hint}"
        )

    # -- the draft's forward flags --------------------------------------------------------------

    def forwards_for(self, version: str | None = None) -> list[DraftForward]:
        """The rows that say how ``version`` computes a draft (None: every version read; a version
        not read: every version read, which the caller says it judged instead)."""
        exact = [f for f in self.forwards if f.version == version]
        return exact or list(self.forwards)

    def forward(self, version: str | None = None) -> DraftForward | None:
        """The row of ``version`` (None or unread: the release this project serves with); None when
        no draft loader of this engine was read."""
        rows = self.forwards_for(version)
        return rows[0] if rows else None

    def draft_flags(self, config: Mapping[str, Any], speculators: bool = False, version: str | None = None) -> Flags:
        """The forward flags it computes for a draft whose config.json is ``config`` (all off where
        no loader was read)."""
        row = self.forward(version)
        return row.flags(config, speculators) if row is not None else Flags()

    def loads(self, speculators: bool) -> bool:
        """Whether it loads a draft of this format (a speculators export, or the flat one)."""
        row = self.forward()
        return row is not None and (row.loads_speculators or not speculators)

    def honours_sliding_window(self, version: str | None = None) -> bool:
        """Whether it attends within the sliding window a draft's config names (else the whole context,
        unless a server option says otherwise)."""
        row = self.forward(version)
        return row is not None and row.window_from_config

    # -- the command line ----------------------------------------------------------------------

    def serve_command(self, target: str, draft: str | None, num_speculative_tokens: int, **flags: Any) -> list[str]:
        """The argv that serves ``target`` with the EAGLE-3 ``draft`` (None: alone), drafting
        ``num_speculative_tokens`` per step, and more ``flags`` (``port=8000``)."""
        if self.serve is None:
            raise ContractError(f"{self.name} has no command that serves a draft")
        return self.serve(target, draft, num_speculative_tokens, flags)

    def dtype_clash(self, draft: str | None, target: str | None) -> str | None:
        """Why a draft of dtype ``draft`` beside a target of dtype ``target`` fails here under
        ``--dtype auto`` (``draft_dtype_own``); None where it does not, or a dtype is unknown."""
        if not self.draft_dtype_own or draft is None or target is None or draft == target:
            return None
        return f"the draft's config names {draft}, the target's {target}, and under --dtype auto {self.draft_dtype_own}"

    def attention_clash(self, draft: AttentionShape | None, target: AttentionShape | None) -> str | None:
        """Why a draft whose attention is shaped ``draft`` beside a target shaped ``target`` may fail
        to start here (``attention_planned_by_target``); None where it does not, or a shape is unknown."""
        if not self.attention_planned_by_target or draft is None or target is None or draft == target:
            return None
        return f"the draft's attention is {draft}, the target's {target}: {self.attention_planned_by_target}"


@dataclass(frozen=True)
class AttentionShape:
    """A decoder layer's attention: query heads, key/value heads, head size."""

    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.heads} heads ({self.kv_heads} key/value) of size {self.head_dim}"


def config_getter(config: Any) -> Callable[[str], Any]:
    """A model config's field by name (None where absent), for a dict or a config object alike."""
    return config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)


def attention_shape(config: Any) -> AttentionShape | None:
    """The attention shape a model config names (a dict or a config object; ``num_key_value_heads``
    defaults to the heads, ``head_dim`` to hidden / heads); None where it names no heads."""
    get = config_getter(config)
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    if not isinstance(heads, int) or heads < 1:
        return None
    head_dim = get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int):
        return None
    return AttentionShape(heads, get("num_key_value_heads") or heads, head_dim)


def named_dtype(config: Any) -> str | None:
    """The dtype a model config names (``torch_dtype`` or ``dtype``; a dict or a config object),
    without torch's ``torch.`` prefix; None: none named."""
    get = config_getter(config)
    value = get("torch_dtype") or get("dtype")
    text = str(value)
    return text.removeprefix("torch.") if isinstance(value, str) or text.startswith("torch.") else None


def lookup(config: dict, path: tuple[str, ...]) -> Any:
    """The value at key ``path`` of a nested dict (None: absent)."""
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node
