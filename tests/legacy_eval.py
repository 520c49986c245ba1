"""eagle3-eval's decoder as it was before batching (commit 1201e79), kept verbatim as the
independent reference: batch 1, the draft recomputing fc + midlayer over the whole context every
verify step (quadratic in the generation length), plain greedy through ``generate``. The tests
check the batched decoder against it token for token.
Not part of the library.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from eagle3_train.model import Eagle3Draft
from eagle3_train.targets import Target


class LegacySpecDecoder:
    """Greedy chain speculative decoding: target (transformers, KV cache) + draft.

    Args:
        target: the loaded target.
        draft: the draft head.
        layers: HF indices whose states feed the draft (``N`` = the last layer's pre-norm output,
            what an engine captures for it).
        k: draft tokens per verify step.
        eos: ids that end generation.
    """

    def __init__(self, target: Target, draft: Eagle3Draft, layers: list[int], k: int, eos: set[int]):
        self.target, self.draft, self.layers, self.k, self.eos = target.model, draft, layers, k, eos
        self.n = target.num_hidden_layers
        self.device = next(self.target.parameters()).device
        self.dtype = next(self.target.parameters()).dtype
        self._prenorm: list[torch.Tensor] = []
        if self.n in layers:  # engines capture the last layer before the final norm
            self.target.base_model.layers[-1].register_forward_hook(
                lambda m, i, o: self._prenorm.append(o[0] if isinstance(o, tuple) else o)
            )
        self.target_seconds = self.draft_seconds = 0.0

    def _target(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over ``ids`` [1, m] with the cache: logits [m, V], aux [m, n*H]."""
        start = time.perf_counter()
        self._prenorm.clear()
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        states = [self._prenorm[-1] if k == self.n else out.hidden_states[k] for k in self.layers]
        aux = torch.cat(states, dim=-1)[0]
        logits = out.logits[0]
        self._sync()
        self.target_seconds += time.perf_counter() - start
        return logits, aux

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _draft(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> list[int]:
        """k draft tokens (target ids) after the context: aux [T, n*H], next_tokens [T] (token t+1)."""
        start = time.perf_counter()
        d = self.draft
        t = aux.shape[0]
        hidden = d.fc(aux[None].to(d.fc.weight.dtype))  # [1, T, n*H] -> [1, T, H]
        cache: list = []
        out = d.step(hidden, next_tokens[None], torch.arange(t, device=hidden.device)[None], cache, 0)[:, -1:]
        drafts = []
        for i in range(self.k):
            draft_id = int(d.logits(out)[0, -1].argmax())
            token = draft_id + int(d.d2t[draft_id])
            drafts.append(token)
            if i + 1 == self.k:
                break
            # chain step i+1 at position T-1+i+1: sees the context and its own earlier steps
            out = d.step(
                out,
                torch.tensor([[token]], device=out.device),
                torch.tensor([[t + i]], device=out.device),
                cache,
                i + 1,
            )
        self._sync()
        self.draft_seconds += time.perf_counter() - start
        return drafts

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list[int]]:
        """Greedy speculative decoding; returns the new tokens and each verify step's accepted count."""
        from transformers import DynamicCache

        cache = DynamicCache()
        logits, aux = self._target(torch.tensor([prompt], device=self.device), cache)
        seq = list(prompt) + [int(logits[-1].argmax())]  # the cache holds all of seq but its last token
        accepted: list[int] = []
        while len(seq) - len(prompt) < max_new and seq[-1] not in self.eos:
            drafts = self._draft(aux, torch.tensor(seq[1:], device=self.device))
            logits, new_aux = self._target(torch.tensor([[seq[-1]] + drafts], device=self.device), cache)
            greedy = logits.argmax(-1).tolist()  # [k+1]: the target's token after each prefix
            a = 0
            while a < self.k and drafts[a] == greedy[a] and drafts[a] not in self.eos:
                a += 1
            drop = cache.get_seq_length() - (len(seq) + a)  # the rejected drafts' entries
            if drop > 0:
                cache.crop(-drop)  # negative: "remove this many" in every transformers version
            aux = torch.cat([aux, new_aux[: a + 1]])
            seq += drafts[:a] + [greedy[a]]
            accepted.append(a)
        new = seq[len(prompt) :]
        for i, tok in enumerate(new):  # as plain greedy decoding: stop at the first eos
            if tok in self.eos:
                new = new[: i + 1]
                break
        return new[:max_new], accepted

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        """Plain greedy decoding of the target, the reference for losslessness."""
        out = self.target.generate(
            torch.tensor([prompt], device=self.device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=sorted(self.eos),
            pad_token_id=sorted(self.eos)[0],
        )
        return out[0, len(prompt) :].tolist()
