"""How shards store hidden states (``storage=`` of eagle3-dump and eagle3-standardize).

- ``dtype``: as the target computed them, in the capture's ``dtype``.
- ``fp8``: float8 e4m3 with one float32 scale per token and layer. A state ``x`` of n layers side
  by side, [T, n*H] (n = 1 in a dump, n_aux for a standardized ``aux_hidden``), is stored as
  ``q`` float8_e4m3fn [T, n*H] under its own key and ``s`` float32 [T, n] under ``<key>.scale``,
  where, for each token t and layer slice i,

      s[t, i] = max |x[t, i*H:(i+1)*H]| / 448          (448: e4m3's largest finite value)
      q[t, i*H + j] = round_to_nearest_e4m3(x[t, i*H + j] / s[t, i])

  and it reads back as ``q * s`` (in float32, then cast to the training dtype). The largest
  element of each token's layer maps to 448 exactly, so nothing saturates, and every element
  keeps e4m3's 3 mantissa bits: ``|x - q*s| <= 2^-4 |x|`` where ``|x| >= 2^-6 s`` (normal
  range), and ``<= 2^-10 s`` below it (subnormals). A token whose layer is all zero gets
  ``s = 0`` and ``q = 0``; a non-finite one gets a non-finite ``s`` (the dump drops such samples).

The reason for per-token scales: the residual stream's scale varies by orders of magnitude from
token to token (the first token's state is often 100x the rest), while within a token a few
outlier channels dominate; a floating-point format with a per-token scale keeps both the
outliers and the small channels (README: "Compact storage"; an int8 grid with the same scales
loses the small channels to the outliers).
"""

from __future__ import annotations

import math

import torch

from eagle3_train.core.contract import STORAGES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = ".scale"
DTYPE, FP8_STORAGE = STORAGES  # "dtype", "fp8"


def scale_key(key: str) -> str:
    """The key of a state's scales in a shard (``hidden.15`` -> ``hidden.15.scale``)."""
    return key + SCALE_SUFFIX


def quantize(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., n*H] (``groups`` = n layer slices) -> (q float8_e4m3fn [..., n*H],
    s float32 [..., n]); see the module docstring. Runs where ``x`` is (the dump: on the GPU,
    before the copy to the host)."""
    xs = x.float().unflatten(-1, (groups, -1))  # [..., n, H]
    scale = xs.abs().amax(dim=-1) / FP8_MAX  # [..., n]; NaN/inf propagate
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    q = (xs / divisor).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [..., n*H] float8 and ``scale`` [..., n] -> the states [..., n*H] in ``dtype``
    (multiplied in float32: the scale is not rounded to ``dtype`` first)."""
    x = q.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)
    return x.flatten(-2).to(dtype)


def encode(states: dict[str, torch.Tensor], storage: str) -> dict[str, torch.Tensor]:
    """Per-token states [T, H] by key, as ``storage`` stores them (fp8: each key and its scale)."""
    if storage == DTYPE:
        return states
    out: dict[str, torch.Tensor] = {}
    for key, x in states.items():
        out[key], out[scale_key(key)] = quantize(x)
    return out


def decode(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A shard's (or a sample's) tensors with every fp8 state read back in ``dtype`` and the
    scales left out; other tensors as they are."""
    return {
        k: dequantize(v, tensors[scale_key(k)], dtype) if scale_key(k) in tensors else v
        for k, v in tensors.items()
        if not k.endswith(SCALE_SUFFIX)
    }


def layout(
    keys: list[str], hidden: int, dtype: torch.dtype, storage: str
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor a shard holds for the states ``keys`` (each [T, hidden]): key -> (dtype,
    shape of one token's row)."""
    if storage == DTYPE:
        return {k: (dtype, (hidden,)) for k in keys}
    return {name: spec for k in keys for name, spec in ((k, (FP8, (hidden,))), (scale_key(k), (torch.float32, (1,))))}


def bytes_per_token(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes one token takes in the tensors of a :func:`layout`."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in shapes.values())


def convert(
    tensors: dict[str, torch.Tensor], keys: list[str], source: str, dest: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The states ``keys`` of a shard stored as ``source``, stored as ``dest`` instead (fp8 read
    back in ``dtype``, or ``dtype`` states quantized; the same storage is passed through)."""
    mine = {name: t for name, t in tensors.items() if name.removesuffix(SCALE_SUFFIX) in keys}
    if source == dest:
        return mine
    return decode(mine, dtype) if source == FP8_STORAGE else encode(mine, dest)


def concat(tensors: dict[str, torch.Tensor], keys: list[str], name: str) -> dict[str, torch.Tensor]:
    """The states ``keys`` (each [T, H]) side by side as ``name`` [T, n*H], in the given order,
    with their scales as ``<name>.scale`` [T, n] when they are stored as fp8."""
    out = {name: torch.cat([tensors[k] for k in keys], dim=1)}
    if scale_key(keys[0]) in tensors:
        out[scale_key(name)] = torch.cat([tensors[scale_key(k)] for k in keys], dim=1)
    return out
