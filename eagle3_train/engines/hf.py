"""Transformers, run in this process: the ``hf`` backend of the dump (``backend=hf``,
data_prep/dump/hf.py) and of regeneration (``regen.backend=hf``, data_prep/regenerate.py).

It plays the roles of an engine that need no server: it produces hidden states and generates
replies, with the target loaded here (so ``tp_size`` and ``compile`` apply to it, and no launch
command exists). It serves no draft, so it has no layer-id rules: eval runs drafts in transformers
too, but by a serving engine's rule (``engine=``).
"""

from __future__ import annotations

from eagle3_train.engines.base import Engine

ENGINE = Engine(name="hf", title="transformers", version="", in_process=True)  # no rules: no version was read
