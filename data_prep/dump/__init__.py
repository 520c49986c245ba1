"""``eagle3-dump``: run the target over a prepared dataset and store per-layer hidden states.

    eagle3-dump target=embedded data=runs/x/prepared out=runs/x/dump
    torchrun --nproc_per_node 8 -m data_prep.dump target=... data=... out=...
    eagle3-dump backend=vllm ... server.url=http://gpu1:8000    # from a served target

Output (docs/concepts/storage.md): ``<out>/shards/*.safetensors`` packing many samples along tokens
(``input_ids``, ``loss_mask``, ``cu_seqlens``, ``sample_ids``, ``hidden.<k>`` for every stored HF
index ``k``, ``last_hidden`` = the post-norm final state), a record ``*.json`` beside each, and
``<out>/manifest.json`` written last.

The modules:

- ``config``: the options (:class:`DumpConfig`); the backends are the engines of
  :mod:`eagle3_train.engines.registry` that produce hidden states;
- ``stage``: the stage itself, whatever the backend (:class:`Dumper`: claim, resume, coverage,
  manifest) and :func:`verify`;
- ``backend``: the one interface the stage calls (:class:`~data_prep.dump.backend.Backend`);
- ``hf``: the target run here in transformers, under torchrun;
- ``served``: the backend of every engine with a hidden-state capture (client processes, retries,
  the next-token check); each engine's launch command, client and answer checks are in its module
  (eagle3_train/engines/vllm.py, sglang.py);
- ``writer``: the shard writer (host buffers, background threads);
- ``cli``: the command.

Started with the same command after a kill, at any moment, a dump finishes with every sample
stored exactly once.
"""

from data_prep.dump.cli import launch_text, main
from data_prep.dump.config import CaptureConfig, ClientConfig, DumpConfig, ServerConfig
from data_prep.dump.stage import Dumper, verify

__all__ = ["CaptureConfig", "ClientConfig", "DumpConfig", "Dumper", "ServerConfig", "launch_text", "main", "verify"]
