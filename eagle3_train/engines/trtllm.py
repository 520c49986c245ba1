"""TensorRT-LLM: its layer-id rule (read from its main branch of 2026-08), nothing more yet.

It reads the ids from ``eagle3_layers_to_capture`` in its own decoding config, not from the draft's
``config.json``, so export writes nothing for it; id v captures HF index v+1. It has no command,
capture, generation or metrics here: adding them (and ``exports=True`` once a ``config.json`` key
is known) makes it a dump and regeneration backend, an export engine and a served-acceptance engine
without touching any consumer.
"""

from __future__ import annotations

from eagle3_train.engines.base import Engine, Rule, plus_one

VERSION = "main-2026-08"

RULES = (
    Rule(
        "main 2026-08",
        "*",
        (("eagle3_layers_to_capture",),),
        plus_one,
        "reads eagle3_layers_to_capture from its own decoding config, not config.json",
    ),
)

ENGINE = Engine(name="trtllm", title="TensorRT-LLM", version=VERSION, rules=RULES)
