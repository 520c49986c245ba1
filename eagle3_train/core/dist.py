"""Process-group helpers: one place that knows ranks, so nothing else has to ask.

Works under ``torchrun`` (any number of nodes and processes) and as a plain single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle3_train.core.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: global rank and size, rank on its node, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


PORT_TRIES = 5  # a group of one picks its port again this many times (another process may take a free one first)


def init_distributed(
    device: str = "auto", timeout_minutes: float = 120.0, always: bool = False, share_gpus: bool = False
) -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment (if any).

    ``device=auto`` picks ``cuda:<local_rank>`` when CUDA is present, else the CPU; the backend
    follows (nccl on CUDA, gloo on CPU). With ``always``, a single process outside torchrun forms a
    group of one (DeepSpeed needs a group). With ``share_gpus`` (work whose ranks only meet at
    barriers, such as generation bound by per-step overhead), a node may run more ranks than it has
    GPUs: rank ``l`` takes ``cuda:<l % GPUs>`` and the group uses gloo, since NCCL refuses two ranks
    on one GPU.
    """
    ours = always and "WORLD_SIZE" not in os.environ  # (a group of one on a port this process picks)
    if ours:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local, share_gpus)
    shared = (
        share_gpus and dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
    )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if (world > 1 or always) and not dist.is_initialized():
        nccl = dev.type == "cuda" and not shared
        for attempt in range(PORT_TRIES if ours else 1):
            try:
                dist.init_process_group(
                    backend="nccl" if nccl else "gloo",
                    timeout=datetime.timedelta(minutes=timeout_minutes),
                    device_id=dev if nccl else None,
                )
                break
            except dist.DistNetworkError:  # the port it picked was taken before it listened: another
                if attempt == PORT_TRIES - 1 or not ours:
                    raise
                os.environ["MASTER_PORT"] = str(_free_port())
    return DistInfo(rank, world, local, dev)


def resolve_device(device: str, local_rank: int = 0, share_gpus: bool = False) -> torch.device:
    """The one reading of ``device=``: ``auto`` is ``cuda:<local_rank>`` when CUDA is present,
    else the CPU; a bare ``cuda`` is ``cuda:<local_rank>`` too (refused without CUDA); anything
    else is taken as torch spells it. A local rank past the node's GPUs is refused unless
    ``share_gpus``, which maps it round-robin."""
    if device not in ("auto", "cuda"):  # (a bare "cuda" is this rank's GPU: torch.cuda.set_device refuses it)
        return torch.device(device)
    if not torch.cuda.is_available():
        if device == "cuda":
            raise ConfigError("device=cuda, but torch sees no CUDA device on this machine: use device=auto or cpu")
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if local_rank >= gpus and not share_gpus:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own ({gpus} on this node): start at most "
            f"{gpus} processes per node (torchrun --nproc_per_node {gpus})"
        )
    return torch.device(f"cuda:{local_rank % gpus}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj``, in rank order (just ``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
