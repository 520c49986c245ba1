"""An exponential moving average of the draft's trainable weights (``optim.ema_decay``): updated
after each optimizer step, the weights that evaluation measures and checkpoints export, saved in
each checkpoint (``ema.safetensors``) so a resumed run averages on as the uninterrupted one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from eagle3_train.core.errors import ContractError

EMA_FILE = "ema.safetensors"  # in a checkpoint directory: the average and its update count


class WeightAverage:
    """The average of ``model``'s trainable parameters, in fp32 on their device.

    Update t (1-based) moves the average toward the weights by ``1 - d_t`` with
    ``d_t = min(decay, (1 + t) / (10 + t))``: early updates follow the fast-moving weights closely
    instead of averaging in the random initialisation.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach().float(), 1 - d)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block and its own weights again after it."""
        with torch.no_grad():
            own = {n: p.detach().clone() for n, p in self.params.items()}
            for name, p in self.params.items():
                p.copy_(self.average[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(own[name])

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the average (on the CPU) and the update count."""
        return {n: t.cpu() for n, t in self.average.items()} | {"__updates__": torch.tensor(self.updates)}

    def load(self, checkpoint: Path) -> None:
        """The average a checkpoint kept (``EMA_FILE``), on this model's devices."""
        from safetensors.torch import load_file

        path = checkpoint / EMA_FILE
        try:
            state = load_file(str(path))
        except Exception as e:  # missing (a checkpoint of a run without the average), or unreadable
            raise ContractError(
                f"{path}: the weight average of optim.ema_decay={self.decay} cannot be read ({type(e).__name__}: {e}); "
                f"resume from a checkpoint of a run with the same optim.ema_decay"
            ) from e
        updates = state.pop("__updates__", None)
        if updates is None or set(state) != set(self.average):
            raise ContractError(
                f"{path}: holds the average of {sorted(state)} (update count {'absent' if updates is None else 'present'}), "
                f"this draft trains {sorted(self.average)}"
            )
        self.updates = int(updates)
        for name, t in state.items():
            self.average[name].copy_(t)
