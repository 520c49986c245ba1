"""Any EAGLE-3 draft directory as eagle3-check and eagle3-eval read it: ours, or one exported by
another framework (vllm-project/speculators, NVIDIA ModelOpt, SpecForge), taken as it was written.

    dd = read_draft_dir(Path("some/draft"))
    dd.producer, dd.version          # "speculators", "0.9.0"
    dd.capture(num_layers)           # the HF indices it says it was trained on, and where it says so
    dd.flags("vllm")                 # the forward variant that engine computes for it
    default_engine(dd)               # the engine eval computes it as, by default: one that loads its format
    dd.weights()                     # its tensors under our names (midlayer.*, aux_norm, fc_norm.<i>)

What each producer writes (their own export code, run on tiny models: ``tests/fixtures/peers``):

- **eagle3_train**: ``LlamaForCausalLMEagle3``, ``midlayer.*``, ids top-level (HF indices, vLLM) and
  in ``eagle_config`` (HF - 1, SGLang), and the ``eagle3_train`` block recording the capture, the
  target, the states' engine and dtype, the chat template flags and the training.
- **speculators** (``speculators_model_type``): ``Eagle3DraftModel``, the layer's shapes in
  ``transformer_layer_config``, ``layers.0.*``, top-level ids as HF indices, its forward flags
  (``norm_before_fc`` with the weight ``input_norm``, ``norm_before_residual``, ``norm_output``,
  ``fc_norm``), a sliding window, the target's embeddings, ``d2t`` and a boolean ``t2d``.
- **ModelOpt**: ``LlamaForCausalLMEagle3``, ``layers.0.*``, ids only in ``eagle_config`` as 0-based
  layer outputs (HF - 1) beside ModelOpt's own keys (``use_last_layernorm`` ...), no ``t2d``, and a
  YaRN ``rope_scaling`` written at export.
- **SpecForge** (and the EAGLE reference code, the same layout): ``LlamaForCausalLMEagle3``,
  ``midlayer.*``, ids in ``eagle_config`` (HF - 1) only when its draft config had them, else
  nothing (the capture was then SpecForge's default).

The engines' side is asked of the engine objects (:mod:`eagle3_train.engines.registry`): which
forward flags each version computes and which formats it loads (:mod:`eagle3_train.engines.heads`).
Both load ``midlayer.*`` and ``layers.0.*`` and size ``fc`` for ``num_aux_hidden_states``, else the
count of ``eagle_config`` ids, else 3 states.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_train.core.errors import BadInputError
from eagle3_train.engines import registry
from eagle3_train.engines.heads import Flags  # noqa: F401  (re-exported: eval and check name it here)

OURS, SPECULATORS, MODELOPT, SPECFORGE, OTHER = "eagle3_train", "speculators", "modelopt", "specforge", "other"

TITLES = {
    OURS: "eagle3_train",
    SPECULATORS: "speculators",
    MODELOPT: "NVIDIA ModelOpt",
    SPECFORGE: "SpecForge (or the EAGLE reference code: the same layout)",
    OTHER: "an EAGLE-3 draft of unknown origin",
}

# ModelOpt's keys in eagle_config beside the ids (hf_spec_configs.py of 0.47.0): how its export is told
# from SpecForge's, whose eagle_config holds the ids (and use_aux_hidden_state) only
_MODELOPT_KEYS = ("use_last_layernorm", "next_layer_regular", "use_input_layernorm_in_first_layer", "use_mtp_layernorm")
# SGLang's legacy names of the per-state norms (aux_norm_low/mid/high -> fc_norm.0/1/2)
_LEGACY_FC_NORM = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


def seen(engine: str) -> str:
    """The engine and the release its draft loader was read from for this project (``vLLM 0.26.0``)."""
    e = registry.ENGINES[engine]
    row = e.forward()
    return f"{e.title} {row.version}" if row is not None else e.title


@dataclass(frozen=True)
class Capture:
    """The HF indices a draft says it was trained on, where it says so, and whether it says so at
    all (``recorded`` False: the producer's default, assumed)."""

    hf_indices: list[int] | None
    source: str
    recorded: bool


@dataclass
class DraftDir:
    """One draft directory, read (see the module docstring)."""

    path: Path
    producer: str
    version: str | None
    config: dict[str, Any]  # config.json as written
    layer: dict[str, Any]  # the Llama layer's fields, flat (draft_config_from_json reads them)
    names: set[str]  # the weight names as written
    files: list[Path] = field(default_factory=list)

    @property
    def title(self) -> str:
        return TITLES[self.producer] + (f" {self.version}" if self.version else "")

    def capture(self, num_layers: int) -> Capture:
        """What the draft records about the states it was trained on, as HF indices of a target of
        ``num_layers`` layers (each producer's convention turned into HF indices)."""
        c, n = self.config, num_layers
        nested = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if self.producer == OURS:
            ids = ((c.get("eagle3_train") or {}).get("capture") or {}).get("aux_indices")
            return Capture(ids, "its eagle3_train block (capture.aux_indices)", ids is not None)
        if self.producer == SPECULATORS:
            ids = c.get("eagle_aux_hidden_state_layer_ids")
            if ids is not None:  # speculators' resolve_target_layer_ids: HF indices, as vLLM takes them
                return Capture(list(ids), "eagle_aux_hidden_state_layer_ids (HF indices)", True)
            return Capture([2, n // 2, n - 3], "not recorded: speculators' default [2, N//2, N-3]", False)
        if nested is not None:  # ModelOpt and SpecForge: 0-based layer outputs, HF index - 1
            return Capture(
                [v + 1 for v in nested], "eagle_config.eagle_aux_hidden_state_layer_ids + 1 (layer outputs)", True
            )
        top = c.get("eagle_aux_hidden_state_layer_ids")
        if top is not None:
            return Capture(list(top), "eagle_aux_hidden_state_layer_ids (HF indices)", True)
        who = {MODELOPT: "ModelOpt's", SPECFORGE: "SpecForge's"}.get(self.producer, "the engines'")
        return Capture([2, n // 2, n - 3], f"not recorded: {who} default [2, N//2, N-3]", False)

    def records_ids(self) -> bool:
        """Whether the draft says which layers it was trained on."""
        return self.capture(self.layer.get("num_hidden_layers") or 1).recorded

    def flags(self, engine: str, version: str | None = None) -> Flags:
        """The forward variant ``engine`` (its ``version``; None: the release served here) computes."""
        return registry.ENGINES[engine].draft_flags(self.config, self.producer == SPECULATORS, version)

    def loaders(self) -> list[str]:
        """The engines (export's, in registry order) that load this draft's format."""
        return [e for e in registry.names("export") if registry.ENGINES[e].loads(self.producer == SPECULATORS)]

    def written_flags(self) -> Flags:
        """The forward flags its config asks for: those some engine that loads it computes."""
        every = [self.flags(e) for e in self.loaders()]
        return Flags(**{k: any(getattr(f, k) for f in every) for k in vars(Flags())})

    def trained_flags(self) -> Flags:
        """The forward variant its producer trained: ours as its export records it (the checkpoint's
        DraftConfig flags, else its ``model`` options); ModelOpt's first layer normalises the hidden
        half twice; SpecForge 0.2.0's next step always takes the pre-norm output; else as written."""
        f = self.written_flags()
        if self.producer == OURS:  # its model options, which export completes with the head's flags
            return Flags.of(((self.config.get("eagle3_train") or {}).get("training") or {}).get("model") or {})
        if self.producer == MODELOPT:
            return Flags(f.aux_norm, f.fc_norm, False, False, hidden_input_norm=True)
        if self.producer == SPECFORGE:
            return Flags(f.aux_norm, f.fc_norm, False, False)
        return f

    def as_trained_refusal(self) -> str | None:
        """Why its training forward cannot be computed here, or None."""
        if self.producer == SPECFORGE and self.config.get("norm_output") is False:
            return (
                "SpecForge 0.2.0 trained logits without the final norm (norm_output=false), which eval does not compute"
            )
        return None

    def trained_layer(self) -> dict[str, Any]:
        """The layer's fields as its producer trained it: ModelOpt's export adds YaRN rope scaling
        (factor 32 over 2048 positions) that training did not have: the draft's plain RoPE."""
        rs = self.layer.get("rope_scaling") or {}
        injected = (
            rs.get("rope_type") == "yarn"
            and rs.get("factor") == 32
            and rs.get("original_max_position_embeddings") == 2048
        )
        if self.producer == MODELOPT and injected:
            return {**self.layer, "rope_scaling": None, "rope_parameters": None}
        return self.layer

    def _unflagged(self, engine: str, what: str) -> list[str]:
        """Weights (our names) of a flag's norm that ``engine`` does not compute, where it ``what``
        (``skips`` or ``fails`` on) them."""
        row = registry.ENGINES[engine].forward()
        if row is None:
            return []
        f, ours = self.flags(engine), {self.our_name(n) for n in self.names}
        return sorted(
            n
            for flag, read in row.reads.items()
            if read.weight and read.unflagged == what and not getattr(f, flag)
            for n in ours
            if n == f"{flag}.weight" or n.startswith(f"{flag}.")
        )

    def skipped_by(self, engine: str) -> list[str]:
        """Weights (our names) that ``engine`` loads and never applies: a flag's norm with the flag
        off, where the engine skips it (an engine that fails on it: :meth:`refusal`)."""
        return self._unflagged(engine, "skips")

    def sliding_window(self) -> int | None:
        """vLLM's window for the draft layer (``layer_types`` says ``sliding_attention``), else None."""
        types = self.layer.get("layer_types") or []
        return self.layer.get("sliding_window") if types and types[0] == "sliding_attention" else None

    def our_name(self, name: str) -> str:
        """A weight's name in our draft (:class:`eagle3_train.model.Eagle3Draft`)."""
        if name.startswith("layers.0."):
            return "midlayer." + name[len("layers.0.") :]
        head, _, rest = name.partition(".")
        if head == "input_norm":
            return "aux_norm." + rest
        if head in _LEGACY_FC_NORM:
            return _LEGACY_FC_NORM[head] + "." + rest
        return name

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor, under our names."""
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                for key in list(st.keys()):
                    out[self.our_name(key)] = st.get_tensor(key)
        return out

    def recorded(self) -> list[str]:
        """What the draft records about how it was trained, in words."""
        c = self.config
        if self.producer == OURS:
            return ["capture (HF indices), target identity and config hash, states' engine and dtype, "
                    "chat template flags, TTT length, vocab map"]  # fmt: skip
        out = []
        if self.producer == SPECULATORS:
            verifier = (c.get("speculators_config") or {}).get("verifier") or {}
            out.append(f"target {verifier.get('name_or_path')} ({', '.join(verifier.get('architectures') or [])})")
            proposal = ((c.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
            if proposal.get("speculative_tokens") is not None:
                out.append(f"{proposal['speculative_tokens']} speculative tokens (its proposal config)")
        changed = self.written_flags().changed()
        if changed:
            out.append("forward flags " + ", ".join(changed))
        if self.sliding_window():
            out.append(f"sliding window {self.sliding_window()}")
        if self.producer == MODELOPT and (c.get("rope_scaling") or {}).get("rope_type") == "yarn":
            out.append("YaRN rope scaling (written by its export)")
        return out

    def unsaid(self) -> list[str]:
        """What a serving check would want and the draft leaves unsaid."""
        if self.producer == OURS:
            return []
        out = ["the target's revision or config hash", "the engine and dtype that computed its states",
               "the chat template and its flags", "how many TTT steps it was trained for"]  # fmt: skip
        if self.producer != SPECULATORS:
            out.insert(0, "which target it was trained for")
        if not self.records_ids():
            out.insert(0, "the layers it was trained on")
        return out

    def train_serve_notes(self) -> list[str]:
        """Where the engines compute this producer's export otherwise than the producer trained it
        (read from its training code; see benchmarks/notes/peer_forward.md)."""
        c = self.config
        out = []
        if self.producer == MODELOPT:
            out.append(
                "ModelOpt trains the first layer's hidden half as hidden_norm(input_layernorm(h)) (transformers' "
                "decoder layer plus its attention hook); the engines compute hidden_norm(h)"
            )
            if (c.get("rope_scaling") or {}).get("rope_type") == "yarn":
                out.append(
                    "its export wrote YaRN rope scaling (factor "
                    f"{c['rope_scaling'].get('factor')}), which the engines apply; ModelOpt trains with the "
                    "draft's plain RoPE unless told otherwise"
                )
        if self.producer == SPECFORGE and c.get("norm_output") is True:
            out.append(
                "norm_output=true: SpecForge 0.2.0 trains it as 'norm before lm_head' (its next step takes "
                "the pre-norm output); the engines read it as 'the next step takes norm(output)'"
            )
        if self.producer == SPECFORGE and c.get("norm_output") is False:
            out.append(
                "norm_output=false: SpecForge 0.2.0 trains its logits on the un-normed output (lm_head(out)); "
                "the engines apply the final norm before lm_head"
            )
        return out

    def refusal(self, engine: str, fc_width: int | None = None) -> str | None:
        """Why ``engine`` cannot load this draft as written, or None (also for an engine whose draft
        loader was not read: trtllm)."""
        e = registry.ENGINES[engine]
        if not e.forwards:
            return None
        c = self.config
        if not e.loads(self.producer == SPECULATORS):
            return (
                f"{seen(engine)} cannot load a speculators export (no model_type, architecture "
                f"{(c.get('architectures') or ['?'])[0]}): serve it with {' or '.join(self.loaders()) or 'another engine'}"
            )
        ours = {self.our_name(n) for n in self.names}
        if any(n.startswith("layers.") for n in ours) or (self.layer.get("num_hidden_layers") or 1) > 1:
            return "a draft of more than one layer: eval builds the one-layer head the engines' llama_eagle3 builds"
        if self.producer == SPECULATORS and self.layer.get("model_type") not in (None, "llama"):
            return f"a speculators draft of layer type {self.layer.get('model_type')}: eval reads its llama drafts only"
        failing = self._unflagged(engine, "fails")
        if failing:
            return f"{seen(engine)} fails on the weights {failing}: their flag is not set"
        th = self.layer.get("target_hidden_size") or self.layer.get("hidden_size")
        ec = c.get("eagle_config") or {}
        states = self.layer.get("num_aux_hidden_states") or len(ec.get("eagle_aux_hidden_state_layer_ids") or []) or 3
        if fc_width is not None and th and fc_width != states * th:
            where = (
                "num_aux_hidden_states"
                if self.layer.get("num_aux_hidden_states")
                else "eagle_config's id count"
                if ec.get("eagle_aux_hidden_state_layer_ids")
                else "no eagle_config ids: 3"
            )
            top = (
                " (its llama draft does not count the top-level ids)"
                if c.get("eagle_aux_hidden_state_layer_ids")
                else ""
            )
            return (
                f"{seen(engine)} sizes fc for {states} states ({where}) of width {th} = {states * th}, but fc takes "
                f"{fc_width}: the load fails{top}"
            )
        return None

    def weight_problems(self) -> list[tuple[str, str]]:
        """(engine, problem) for weights the engines that load it would load without applying
        (:meth:`skipped_by`); one an engine fails on is a :meth:`refusal`."""
        out = []
        for engine in self.loaders():
            row = registry.ENGINES[engine].forward()
            for name in self.skipped_by(engine):  # our name: <flag>.weight or <flag>.<i>.weight
                flag, *i = name.split(".")[:-1]
                read = row.reads[flag] if row is not None else None
                loaded = read.weight.format(i=i[0] if i else "").removesuffix(".weight") if read else name
                key = read.top_key if read else flag
                out.append((engine, f"{seen(engine)} loads {loaded} but never applies it: {key} is not set"))
        return out

    def extra_weights(self) -> set[str]:
        """The draft's weights (our names) beyond the plain head that its written flags account for."""
        f = self.written_flags()
        ours = {self.our_name(n) for n in self.names}
        return {n for n in ours for flag in f.changed() if n == f"{flag}.weight" or n.startswith(f"{flag}.")}


def default_engine(dd: DraftDir) -> str:
    """The engine eval computes a draft as when none is named: the first engine (registry order) that
    loads its format, among those our export was written for. Raises :class:`BadInputError` when no
    engine loads it."""
    recorded = (dd.config.get("eagle3_train") or {}).get("engines") if dd.producer == OURS else None
    fits = [e for e in dd.loaders() if recorded is None or e in recorded]
    if not fits:
        raise BadInputError(f"{dd.path} ({dd.title}): no engine this project knows loads it; name one with engine=")
    return fits[0]


def detect(config: dict[str, Any], names: set[str]) -> tuple[str, str | None]:
    """(producer, version) from what a draft directory holds."""
    if "speculators_model_type" in config:
        return SPECULATORS, config.get("speculators_version")
    if "eagle3_train" in config:
        return OURS, (config.get("eagle3_train") or {}).get("version")
    ec = config.get("eagle_config") or {}
    if any(k in ec for k in _MODELOPT_KEYS):
        return MODELOPT, None
    if any(n.startswith("midlayer.") for n in names):
        return SPECFORGE, None
    return OTHER, None


def read_draft_dir(path: Path) -> DraftDir:
    """Read ``path``'s config.json and weight names (tensors on demand: :meth:`DraftDir.weights`)."""
    if not (path / "config.json").is_file():
        raise BadInputError(f"{path} has no config.json: not a draft directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"{path} has no .safetensors weights")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise BadInputError(f"{path}/config.json: not JSON ({e})") from e
    if not isinstance(config, dict):
        raise BadInputError(f"{path}/config.json: not a JSON object")
    for key in ("eagle_config", "transformer_layer_config", "eagle3_train"):
        if key in config and config[key] is not None and not isinstance(config[key], dict):
            raise BadInputError(f"{path}/config.json: {key} is not an object")
    for where, ids in (
        ("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
        (
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
        ),
    ):
        if ids is not None and not (isinstance(ids, list) and all(isinstance(v, int) for v in ids)):
            raise BadInputError(f"{path}/config.json: {where} is not a list of integers: {ids!r}")
    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(st.keys())
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise BadInputError(f"{f}: not a readable safetensors file ({e})") from e
    producer, version = detect(config, names)
    layer = dict(config)
    if producer == SPECULATORS:
        tl = config.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise BadInputError(f"{path}/config.json: a speculators config without transformer_layer_config")
        layer = {
            **tl,
            "draft_vocab_size": config.get("draft_vocab_size"),
            "target_hidden_size": config.get("target_hidden_size"),
        }
    return DraftDir(path, producer, version, config, layer, names, files)
