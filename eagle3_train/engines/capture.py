"""The served dump's side of an engine (``eagle3-dump backend=<engine>``): what an engine module
fills so that data_prep/dump/served.py can take a dump's hidden states from a running engine.

The dump owns the client processes, the retries, the shards and the next-token check; an engine's
:class:`StateCapture` says which servers it needs, which engine ids capture the stored HF indices
(refusing what it cannot capture before anything is launched), the command(s) that start it for a
capture, and the client that turns one sample's answer into states ({``hidden.<k>``,
``last_hidden``: [T, H]}). The options the dump passes (:class:`ServerConfig`,
:class:`ClientConfig`) are the ``server.*`` and ``client.*`` sections of ``conf/dump.yaml``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from eagle3_train.core.errors import check_numbers
from eagle3_train.engines.http import EngineError

NEXT_TOKEN_TOP_K = 5  # the engine's next token must be among the checkpoint's top-k ...
NEXT_TOKEN_MIN_AGREEMENT = 0.9  # ... on at least this share of samples (checked from 16 on)


@dataclass
class ServerConfig:
    """Where ``backend=vllm|sglang`` finds the engine (eagle3_train/engines/vllm.py, sglang.py)."""

    url: str = "http://127.0.0.1:8000"  # the vLLM server, or SGLang's aux-state server
    final_url: str = "http://127.0.0.1:30001"  # SGLang only: the server that returns the post-norm final state
    model: str | None = None  # vLLM's served model name; null: the first one /v1/models lists
    files_dir: str | None = None
    """vLLM: the shared directory the engine writes states to, as this client sees it (null: <out>/engine_files)"""
    server_files_dir: str | None = None  # vLLM: the same directory as the engine sees it (null: files_dir)
    engine_args: str = ""  # extra engine flags (parallelism: --tp-size 4) for the printed launch commands; checked against what the dump needs


@dataclass
class ClientConfig:
    """How ``backend=vllm|sglang`` sends requests; each client process takes its share of samples."""

    rank: int | None = None  # this client's index (null: $RANK, else 0)
    world_size: int | None = None  # number of client processes (null: $WORLD_SIZE, else 1)
    concurrency: int = 32  # requests in flight per client process (the engine batches them)
    request_timeout_s: float = 600.0  # one request's time limit
    file_timeout_s: float = 600.0  # vLLM: longest wait for a state file once its response came
    retries: int = 5  # further attempts after a transient failure (connection, 5xx, timeout)
    backoff_s: float = 1.0  # the first retry's delay; doubled on every further one (at most 60 s)
    wait_for_server_s: float = 900.0  # how long to wait at start for the servers' /health
    check_next_token: bool = True  # compare the engine's next token with lm_head(last_hidden)
    keep_files: bool = False  # vLLM: keep the engine's per-request files after reading them

    def __post_init__(self) -> None:
        check_numbers(
            self,
            "client.",
            positive=("world_size", "concurrency", "request_timeout_s", "file_timeout_s", "wait_for_server_s"),
            non_negative=("rank", "retries", "backoff_s"),
        )


@dataclass(frozen=True)
class CaptureJob:
    """What one client process of a served dump asks the engine for.

    Args:
        stored: the HF indices to store, ascending.
        model_type: the target's ``model_type``.
        num_hidden_layers: the target's N.
        hidden_size: the target's hidden size H.
        rms_norm_eps: the epsilon of the target's final norm.
        dtype: the dtype the engine computes (and the states are stored) in.
        rank: this client's index.
        out: the dump directory.
        server: where the engine is.
        client: how this client asks.
    """

    stored: list[int]
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    rms_norm_eps: float
    dtype: torch.dtype
    rank: int
    out: Path
    server: ServerConfig
    client: ClientConfig


class EngineClient(Protocol):
    """Talks to one engine (its servers) for one client process."""

    async def start(self, session: Any) -> None:
        """Wait for the servers; set up what requests need."""

    async def fetch(self, session: Any, sample_id: int, prompt: list[int], attempt: int) -> tuple[dict, int | None]:
        """One sample's states ({``hidden.<k>``, ``last_hidden``: [T, H]}, checked) and the engine's
        greedy next token (None if it gives none); raises ``Transient`` for what a retry may fix."""


class StateCapture(ABC):
    """One engine's hidden-state capture for the served dump.

    Args:
        read_from: the engine version whose API was read (``0.33.0``).
        tensors: checkpoint tensors the answers need (``load_target_tensors`` names).
        memory_flag: its flag for the GPU memory share it takes ("": none known).
        length_flag: its flag for the longest sequence it serves ("": none known).
        oldest: (the oldest release whose state return was read, why older ones are refused); None: any.
        final_server: each replica returns the post-norm final state from a second server.
        writes_files: the engine writes the states to files in a directory both sides see.
    """

    read_from: str = ""
    tensors: tuple[str, ...] = ()
    memory_flag: str = ""
    length_flag: str = ""
    oldest: tuple[str, str] | None = None
    final_server: bool = False
    writes_files: bool = False

    @abstractmethod
    def servers(self, server: ServerConfig) -> dict[str, str]:
        """The servers this engine needs: {option name: URL}."""

    @abstractmethod
    def layer_ids(self, stored: list[int], model_type: str, num_hidden_layers: int, server: ServerConfig) -> list[int]:
        """The engine ids that capture ``stored``; raises (with the reason) what the engine
        cannot capture or serve, before anything is launched."""

    @abstractmethod
    def launch_lines(
        self,
        model_path: str,
        model_type: str,
        num_hidden_layers: int,
        stored: list[int],
        dtype: str,
        server: ServerConfig,
        out: str | None,
    ) -> list[str]:
        """The command(s) that start the engine for ``stored``, with comments."""

    @abstractmethod
    def client(self, job: CaptureJob, tensors: dict[str, torch.Tensor]) -> EngineClient:
        """The client for one dump, given the checkpoint tensors it asked for."""


def port_of(url: str, default: int) -> int:
    """The port of a server URL (``default`` when it names none)."""
    return urlparse(url).port or default


def first_difference(got: list[int], want: list[int]) -> str:
    """Where two token lists part, for a message."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"position {i}: engine {a}, prompt {b}"
    return f"lengths: engine {len(got)}, prompt {len(want)}"


class NextTokenCheck:
    """Does the engine serve this target, from these layers? Its greedy next token should be (near)
    the top of the checkpoint's ``lm_head(last_hidden)``; a low agreement means another model, or a
    last captured state that is not the final layer.

    Args:
        head: the target's lm_head weight [V, H] (host memory).
        target: how messages name the target.
        hint: where the message sends the user (how to see the engine's launch command).
    """

    def __init__(self, head: torch.Tensor, target: str, hint: str):
        self.head, self.target, self.hint = head, target, hint
        self.counts = {"checked": 0, "agreed": 0}

    def __call__(self, last: torch.Tensor, token: int, sample_id: int) -> None:
        """Count one sample (``last``: its last position's post-norm state [H]); raises
        :class:`EngineError` once 16 or more are counted and too few agree."""
        logits = self.head @ last.to(self.head.dtype)  # [V]
        top = logits.float().topk(NEXT_TOKEN_TOP_K).indices.tolist()
        a = self.counts
        a["checked"] += 1
        a["agreed"] += token in top
        if a["checked"] >= 16 and a["agreed"] < NEXT_TOKEN_MIN_AGREEMENT * a["checked"]:
            raise EngineError(
                f"the engine's next token is outside the top {NEXT_TOKEN_TOP_K} of lm_head(last_hidden) of target "
                f"{self.target} on {a['checked'] - a['agreed']} of {a['checked']} samples (e.g. sample {sample_id}: "
                f"engine {token}, checkpoint top {top}): the engine serves another model, or its last captured state "
                f"is not the final layer ({self.hint})"
            )
