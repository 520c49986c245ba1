"""Hidden-state capture from a transformers target: the one forward pass that turns token ids into
the states a draft trains on (docs/concepts/hf-index.md), shared by the dump (data_prep/dump/hf.py) and anything
that captures online.

    states = capture(target.model, input_ids, None, [1, 2, 3])
    aux = states.aux([1, 2, 3])          # [B, T, 3*H], ascending HF index
    states.last_hidden                   # [B, T, H], post-norm: the lm_head input
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_train.core.errors import ConfigError, ContractError


@dataclass
class States:
    """What one forward pass captured.

    Args:
        layers: HF index ``k`` -> ``hidden_states[k]`` [B, T, H] (``k < N``).
        last_hidden: the post-norm final state [B, T, H] (``hidden_states[N]``).
    """

    layers: dict[int, torch.Tensor]
    last_hidden: torch.Tensor

    def aux(self, indices: Sequence[int]) -> torch.Tensor:
        """The aux input of the draft: the states of ``indices`` concatenated in ascending HF
        index, as every engine concatenates them. [B, T, H] x n -> [B, T, n*H]."""
        missing = sorted(set(indices) - set(self.layers))
        if missing:
            raise ContractError(f"HF indices {missing} were not captured (captured: {sorted(self.layers)})")
        return torch.cat([self.layers[k] for k in sorted(indices)], dim=-1)


def capture(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, indices: Sequence[int]) -> States:
    """Run the target's decoder (not its lm_head) once over ``input_ids`` [B, T] and keep the
    hidden states of the HF ``indices`` (each ``0 <= k < N``) and the post-norm final state.

    With right padding, ``attention_mask`` may be None: attention is causal, so a real token never
    sees the padding after it and its states are those of its sample run alone (what the dump
    does, saving the mask's cost). Left padding needs the mask and position ids the model derives
    from it, which plain decoders do not; do not left-pad.

    Args:
        model: a transformers causal LM (its ``base_model`` is the decoder).
        input_ids: [B, T] token ids on the model's device.
        attention_mask: [B, T] 1 for real tokens, or None (see above).
        indices: HF indices to keep; N (the post-norm state) is always returned as ``last_hidden``.
    """
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
    )
    hidden = out.hidden_states  # N+1 tensors [B, T, H]; [N] is post-norm
    n = len(hidden) - 1
    bad = [k for k in indices if not 0 <= k < n]
    if bad:
        raise ContractError(
            f"HF indices {bad} are out of range 0..{n - 1} for a target with N={n} layers "
            f"(N, the post-norm state, is last_hidden)"
        )
    return States({int(k): hidden[k] for k in indices}, hidden[n])


def compile_layers(model: Any, option: str) -> None:
    """torch.compile each decoder layer of a transformers target in place, with dynamic batch and
    length (one compilation serves every layer and every batch shape). What runs between the layers
    (the embedding, rotary tables, the hidden-state recording, the final norm) stays eager, so
    :func:`capture` is the same code; the fused kernels only reorder float operations within a layer,
    and a layer launches a few kernels instead of dozens. ``option`` is the user's switch
    (``compile=true``, ``online.compile=true``), named where the target cannot take it."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"{option}: {type(model.base_model).__name__} keeps no decoder layers in "
            f"base_model.layers to compile; run without it"
        )
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:  # (a model already compiled stays as it is)
            layer.compile(dynamic=True)
