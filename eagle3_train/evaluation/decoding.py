"""Batched greedy speculative decoding: a transformers target and an EAGLE-3 draft, both with KV caches.

The engine of ``eagle3-eval``. A batch's rows share one cache layout of ``L`` columns, the target's
(every layer of a transformers ``DynamicCache``) and the draft's step-0 cache (``cache[0]`` of
:meth:`Eagle3Draft.step`) column for column; ``valid`` [B, L] marks the columns that belong to each
row, in position order. Prompts are left-padded. A round drafts ``k`` tokens per row
(:meth:`Eagle3Draft.propose`), verifies them in one target forward over ``[last token, drafts]``
[B, k+1], and appends the k+1 columns of which the row's accepted ``1 + a_b`` stay valid; the draft's
step 0 then runs over those same new columns only (the target's states of the accepted tokens), so a
round costs the draft ``m + k - 1`` positions per row (m <= k+1) whatever the context length. Rows that
finish leave the batch; when invalid columns make up more than a quarter of the layout, the valid
ones are gathered to the right (compaction).

Tree drafts (:mod:`eagle3_train.evaluation.tree`) change only the middle of a round: the draft
proposes a tree of N nodes per row, the target verifies the N nodes in one forward under the tree
mask (4-D, each node seeing the row's valid columns and its own ancestors), and the accepted path's
N-column entries are gathered to the first ``1 + a`` new columns in path order -- after which the
round goes on exactly as a chain's whose drafts were the path.

Why this is exact: every query sees its row's valid columns up to its own (2-D attention mask for the
target, [B, T, L] boolean mask for the draft) at its row's own RoPE positions, so masked columns get
softmax weight exactly 0 and a row's tokens are those it gets alone; only the summation order of
floating-point reductions differs with the batch's shapes. With one row and no padding no mask and no
position ids are passed at all: the target runs exactly as plain ``DynamicCache`` decoding does, and
the rejected drafts' columns are cropped.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F

from eagle3_train.core.errors import ContractError
from eagle3_train.evaluation.tree import DraftTree, TreeShape, accept_path, propose_tree
from eagle3_train.model import Eagle3Draft

T = TypeVar("T")


@dataclass
class Decoded:
    """One prompt's speculative decoding: new tokens (cut after the first eos and at max_new) and
    each verify step's accepted draft count."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)


@dataclass
class Reference:
    """One prompt's plain greedy decoding, with the top-1 minus top-2 logit margin at each position."""

    tokens: list[int]
    margins: list[float] = field(default_factory=list)


@dataclass
class Counters:
    """What speculative decoding did: wall seconds of target forwards and of the draft, the positions the
    draft processed in decode rounds (prefill excluded) over ``row_rounds`` (rows x verify steps),
    and how often the batch's caches were compacted."""

    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_positions: int = 0
    row_rounds: int = 0
    compactions: int = 0


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, L] (pad id 0) and the valid mask [B, L] of left-padded prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    valid = torch.arange(width)[None] >= (width - lengths)[:, None]
    return ids.to(device), valid.to(device)


def extend_mask(valid_old: torch.Tensor, valid_new: torch.Tensor) -> torch.Tensor:
    """Which keys the queries of new columns see: [B, L] + [B, T] -> [B, T, L+T] (bool).

    A query sees the valid columns up to its own (causal over the layout, whose valid columns are in
    position order). It always sees itself, so no row is empty: an invalid query's output is junk
    but finite, and nothing valid ever reads it.
    """
    n_old, t = valid_old.shape[1], valid_new.shape[1]
    valid = torch.cat([valid_old, valid_new], dim=1)  # [B, L+T]
    col = torch.arange(n_old + t, device=valid.device)
    row = n_old + torch.arange(t, device=valid.device)
    causal = col[None, :] <= row[:, None]  # [T, L+T]
    return (valid[:, None, :] & causal[None]) | (col[None, :] == row[:, None])[None]


def sliding_window_of(config: Any) -> int | None:
    """The target's attention window if any of its layers is windowed (gpt-oss, Mistral, Qwen2 with
    ``use_sliding_window``), else None."""
    c = config.get_text_config()
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if not window or getattr(c, "use_sliding_window", True) is False or (types and "sliding_attention" not in types):
        return None
    return int(window)


def position_masks(
    valid: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    layer_types: list[str] | None,
    dtype: torch.dtype,
    tree: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive attention masks [B, 1, T, L] for queries at ``positions`` [B, T] over the columns
    ``valid`` [B, L] (the last T of them the queries' own), measured in each row's token positions.

    transformers measures a sliding window in cache columns; the batched layout keeps a row's
    rejected drafts as invalid columns between its tokens, so a window of W columns would hold fewer
    than W of the row's tokens and the row would see less than it sees alone. Here a column's
    position is the count of valid columns before it, the position RoPE gave its token. Returns the
    full-attention mask alone when every layer is windowed the same way, else a mask per layer type
    (what transformers' mixed-attention models take as ``attention_mask``).

    ``tree`` [B, T, T] (bool): the queries are a draft tree's nodes, each seeing among the last T
    columns only itself and its ancestors (``DraftTree.ancestors``), at the positions given (siblings
    share one), instead of every earlier query.
    """
    col = valid.long().cumsum(1) - 1  # [B, L] token position of each valid column
    q = positions[:, :, None]  # [B, T, 1]
    full = valid[:, None, :] & (col[:, None, :] <= q)  # [B, T, L]
    if tree is not None:  # the context part as above; the nodes' part is the ancestor pattern
        t = tree.shape[1]
        col = torch.cat([col[:, :-t], positions], dim=1)
        full = torch.cat([full[:, :, :-t], tree], dim=2)
    sliding = full & (col[:, None, :] > q - window) if window else full
    neg = torch.finfo(dtype).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, neg)[:, None]

    if not layer_types or set(layer_types) == {"sliding_attention"}:  # every layer windowed alike
        return additive(sliding)
    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


def compaction_index(valid: torch.Tensor) -> torch.Tensor:
    """For each row, the columns to keep right-aligned: [B, L] -> [B, n], n = most valid columns of a
    row. A stable sort puts a row's invalid columns first and its valid ones last, in order."""
    n = int(valid.sum(1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices  # [B, L]
    return order[:, valid.shape[1] - n :]


def gather_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, d], index [B, n] -> [B, heads, n, d]."""
    b, h, _, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


def in_batches(prompts: list[list[int]], batch_size: int, run: Callable[[list[list[int]]], list[T]]) -> list[T]:
    """``run`` over batches of ``batch_size`` prompts, longest first (a batch's prompts are alike in
    length, little padding); results in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Any] = [None] * len(prompts)
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        for i, r in zip(chunk, run([prompts[i] for i in chunk])):
            results[i] = r
    return results


@dataclass
class _Batch:
    """The rows of one speculative batch still decoding, their caches, and what the next round reads."""

    rows: list[int]  # each live row's index into the batch's prompts
    lengths: list[int]  # each live row's valid columns = the position of its newest token
    cache: Any  # the target's transformers cache, every layer [B, heads, L, d]
    dcache: list[tuple[torch.Tensor, torch.Tensor]]  # the draft's step-0 cache, column for column
    valid: torch.Tensor  # [B, L] the layout's columns that belong to each row
    last: torch.Tensor  # [B] each row's newest token (the target's own), not yet in the caches
    hidden: torch.Tensor  # [B, H] the draft's step-0 output at the row's last accepted column


class SpecDecoder:
    """Greedy speculative decoding of batches of prompts (chain or tree drafts), and the plain greedy
    reference.

    Args:
        model: the target (a transformers causal LM).
        draft: the draft head, on the target's device and dtype.
        layers: HF indices whose states feed the draft (``N`` = the last layer's pre-norm output,
            what an engine captures for it).
        k: draft tokens per verify step of a chain; with ``tree``, the tree's depth (SGLang's
            num_steps).
        eos: ids that end generation.
        tree: draft a tree of this shape per round (:mod:`eagle3_train.evaluation.tree`), verified
            in one target forward under a tree attention mask; None: a chain of ``k``.
    """

    def __init__(
        self, model: Any, draft: Eagle3Draft, layers: list[int], k: int, eos: set[int], tree: TreeShape | None = None
    ):
        self.model, self.draft, self.layers, self.k, self.eos = model, draft, layers, k, eos
        if tree is not None:
            tree.check(k)
        self.tree = tree
        self.n = model.config.get_text_config().num_hidden_layers
        self.device = next(model.parameters()).device
        self.eos_ids = torch.tensor(sorted(eos), device=self.device)
        text = model.config.get_text_config()
        self.window = sliding_window_of(model.config)
        self.layer_types = list(getattr(text, "layer_types", None) or []) or None
        # transformers 5.x renamed the forward's past_key_values to cache (the old name warns)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._prenorm: torch.Tensor | None = None
        if self.n in layers:  # engines capture the last layer before the final norm
            model.base_model.layers[-1].register_forward_hook(self._keep_prenorm)
        self.counters = Counters()

    def _keep_prenorm(self, module: Any, args: Any, out: Any) -> None:
        self._prenorm = out[0] if isinstance(out, tuple) else out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def target_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor | None,
        cache: Any,
        aux: bool,
        last_only: bool = False,
        tree: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over ``ids`` [B, T] at ``positions`` [B, T] with the cache; ``valid``
        [B, L+T] the 2-D attention mask (None: no padding anywhere, plain decoding); ``tree``
        [B, T, T] the ancestor pattern when the queries are a draft tree's nodes (``valid`` then
        required). Returns logits [B, T, V] ([B, 1, V] with ``last_only``) and, with ``aux``, the
        draft's input [B, T, n*H]."""
        start = time.perf_counter()
        mask: Any = None if valid is None else valid.long()
        if valid is not None and (self.window or tree is not None):  # windows counted in tokens, not columns
            mask = position_masks(valid, positions, self.window, self.layer_types, self.model.dtype, tree)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=None if valid is None else positions,
            use_cache=True,
            output_hidden_states=aux,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: cache},
        )
        states = None
        if aux:
            prenorm = cast(torch.Tensor, self._prenorm)  # kept by the hook during this forward when N is fed
            states = torch.cat([prenorm if k == self.n else out.hidden_states[k] for k in self.layers], dim=-1)
        self._sync()
        if aux:  # the speculative path's (plain greedy is timed by its caller)
            self.counters.target_seconds += time.perf_counter() - start
        return out.logits, states

    def _is_eos(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(ids, self.eos_ids)

    # -- speculative ---------------------------------------------------------------------------

    @torch.no_grad()
    def speculative(self, prompts: list[list[int]], max_new: int, batch_size: int) -> list[Decoded]:
        """Greedy speculative decoding of every prompt, ``batch_size`` at a time; results in the
        prompts' order."""
        return in_batches(prompts, batch_size, lambda batch: self._speculative_batch(batch, max_new))

    def _speculative_batch(self, prompts: list[list[int]], max_new: int) -> list[Decoded]:
        live = self._prefill(prompts)
        out = [Decoded([t]) for t in live.last.tolist()]
        self._select(live, [i for i in live.rows if not (max_new <= 1 or out[i].tokens[-1] in self.eos)])
        while live.rows:
            host = self._round(live)
            self._select(live, self._record(live, host, out, max_new))
            if live.rows and 4 * (live.valid.shape[1] - max(live.lengths)) > live.valid.shape[1]:
                self._compact(live)
        for d in out:  # as plain greedy decoding: stop at the first eos, at most max_new tokens
            cut = next((i + 1 for i, t in enumerate(d.tokens) if t in self.eos), len(d.tokens))
            d.tokens = d.tokens[: min(cut, max_new)]
        return out

    def _prefill(self, prompts: list[list[int]]) -> _Batch:
        """The target over the left-padded prompts (its first new token), then the draft's step 0
        over the same columns."""
        from transformers import DynamicCache

        draft = self.draft
        ids, valid = left_pad(prompts, self.device)  # [B, L]
        lengths = [len(p) for p in prompts]  # valid columns per row = position of the row's last token
        padded = len(set(lengths)) > 1
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # [B, L]
        cache = DynamicCache()
        logits, aux = self.target_forward(ids, positions, valid if padded else None, cache, aux=True, last_only=True)
        assert aux is not None  # aux=True
        last = logits[:, -1].argmax(-1)  # [B] the first new token
        start = time.perf_counter()
        dcache: list[tuple[torch.Tensor, torch.Tensor]] = []
        nxt = torch.cat([ids[:, 1:], last[:, None]], dim=1)  # [B, L]: the token after each position
        mask = extend_mask(valid[:, :0], valid) if padded else None
        hidden = draft.step(draft.fuse(aux), nxt, positions, dcache, 0, mask)[:, -1]  # [B, H]
        self._sync()
        self.counters.draft_seconds += time.perf_counter() - start
        return _Batch(list(range(len(prompts))), lengths, cache, dcache, valid, last, hidden)

    def _round(self, live: _Batch) -> list[list[int]]:
        """One verify step of every live row: draft, verify in one target forward, keep the accepted
        columns, run the draft's step 0 over them. Returns per row ``[a, k drafts, the target's token]``."""
        k, b, dev = self.k, len(live.rows), self.device
        slot = torch.arange(k + 1, device=dev)[None]  # [1, k+1]
        length = torch.tensor(live.lengths, device=dev)  # [B]
        padded = len(set(live.lengths)) > 1 or live.valid.shape[1] != live.lengths[0]
        pos = length[:, None] + slot  # [B, k+1] positions of the last token and a chain's drafts
        proposed = self._propose(live, length, padded)
        if isinstance(proposed, DraftTree):
            a, drafts, greedy, aux, path = self._verify_tree(live, proposed, length)
        else:
            (a, drafts, greedy, aux), path = self._verify_chain(live, proposed, pos, padded), None
        last = greedy.gather(1, a[:, None])[:, 0]  # [B] the target's own next token
        host = torch.cat([a[:, None], drafts, last[:, None]], dim=1).tolist()
        m = max(r[0] for r in host) + 1  # new columns kept by some row; the rest are cropped
        self._keep_new_columns(live.cache, m, path, live.valid.shape[1])
        new_valid = slot[:, :m] <= a[:, None]  # [B, m]
        padded = padded or any(r[0] + 1 < m for r in host)
        # step 0 over the new columns: column i of a row predicts after its token i, i.e. draft
        # i+1 while accepted, then the target's own token (later columns: junk, never seen)
        start = time.perf_counter()
        nxt = torch.where(slot[:, :m] < a[:, None], F.pad(drafts, (0, 1))[:, :m], last[:, None])
        mask = extend_mask(live.valid, new_valid) if padded else None
        out0 = self.draft.step(self.draft.fuse(aux[:, :m]), nxt, pos[:, :m], live.dcache, 0, mask)  # [B, m, H]
        live.hidden = out0[torch.arange(b, device=dev), a]  # [B, H] at each row's last accepted column
        self._sync()
        self.counters.draft_seconds += time.perf_counter() - start
        self.counters.draft_positions += b * (m + (k - 1) * (self.tree.topk if self.tree else 1))
        self.counters.row_rounds += b
        live.valid, live.last = torch.cat([live.valid, new_valid], dim=1), last
        return host

    def _propose(self, live: _Batch, length: torch.Tensor, padded: bool) -> torch.Tensor | DraftTree:
        """Each live row's drafts: a chain [B, k], or a tree of this decoder's shape."""
        start = time.perf_counter()
        valid = live.valid if padded else None
        if self.tree is None:
            proposed: torch.Tensor | DraftTree = self.draft.propose(live.hidden, length - 1, live.dcache, self.k, valid)
        else:
            proposed = propose_tree(
                self.draft, live.hidden, live.last, length - 1, live.dcache, self.tree, self.k, valid
            )
        self._sync()
        self.counters.draft_seconds += time.perf_counter() - start
        return proposed

    def _verify_chain(
        self, live: _Batch, drafts: torch.Tensor, pos: torch.Tensor, padded: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One target forward over ``[last token, drafts]`` [B, k+1]. Returns the accepted drafts a [B],
        the drafts, the target's token after each prefix [B, k+1] and its states there [B, k+1, n*H]."""
        k, b = self.k, len(live.rows)
        valid_in = torch.cat([live.valid, live.valid.new_ones(b, k + 1)], dim=1) if padded else None
        logits, aux = self.target_forward(
            torch.cat([live.last[:, None], drafts], dim=1), pos, valid_in, live.cache, aux=True
        )
        assert aux is not None  # aux=True
        greedy = logits.argmax(-1)  # [B, k+1]: the target's token after each prefix
        match = (drafts == greedy[:, :k]) & ~self._is_eos(drafts)
        return match.long().cumprod(1).sum(1), drafts, greedy, aux  # [B] accepted drafts

    def _verify_tree(
        self, live: _Batch, tree: DraftTree, length: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over the N nodes [B, N], each at its depth's position, seeing its ancestors.
        Returns what :meth:`_verify_chain` does along the accepted path, and the path [B, k+1]."""
        k, b = self.k, len(live.rows)
        n = tree.tokens.shape[1]
        valid_in = torch.cat([live.valid, live.valid.new_ones(b, n)], dim=1)
        logits, aux = self.target_forward(
            tree.tokens, length[:, None] + tree.depths, valid_in, live.cache, aux=True, tree=tree.ancestors()
        )
        assert aux is not None  # aux=True
        greedy = logits.argmax(-1)  # [B, N]: the target's token after each node's path
        a, path = accept_path(tree, greedy, self._is_eos(tree.tokens), k)  # path [B, k+1]
        # from here on as a chain's: the accepted path's drafts, the target's choices and states
        drafts, greedy = tree.tokens.gather(1, path[:, 1:]), greedy.gather(1, path)
        aux = aux.gather(1, path[..., None].expand(b, k + 1, aux.shape[-1]))
        return a, drafts, greedy, aux, path

    def _keep_new_columns(self, cache: Any, m: int, path: torch.Tensor | None, old: int) -> None:
        """Of the columns the verify forward appended after the ``old`` ones, keep ``m``: a chain crops
        the rest; a tree keeps only the accepted path's entries, moved to the first m in path order."""
        if path is None:
            self._edit(cache, lambda x, cut=self.k + 1 - m: x[:, :, : x.shape[2] - cut])
        else:
            self._edit(
                cache,
                lambda x, keep=path[:, :m]: torch.cat([x[:, :, :old], gather_columns(x[:, :, old:], keep)], dim=2),
            )

    def _record(self, live: _Batch, host: list[list[int]], out: list[Decoded], max_new: int) -> list[int]:
        """Each row's accepted drafts and the target's own token onto its output; returns the live
        rows (indices into ``live.rows``) that go on."""
        still = []
        for j, (row, r) in enumerate(zip(live.rows, host)):
            acc = r[0]
            out[row].tokens += r[1 : 1 + acc] + [r[-1]]
            out[row].accepted.append(acc)
            live.lengths[j] += acc + 1
            if len(out[row].tokens) < max_new and r[-1] not in self.eos:
                still.append(j)
        return still

    def _select(self, live: _Batch, still: list[int]) -> None:
        """Keep only the live rows ``still`` (indices into ``live.rows``)."""
        if len(still) == len(live.rows):
            return
        keep = torch.tensor(still, dtype=torch.long, device=self.device)
        self._edit(live.cache, lambda x: x[keep])
        live.dcache[:] = [(kk[keep], vv[keep]) for kk, vv in live.dcache[:1]]
        live.valid, live.last, live.hidden = live.valid[keep], live.last[keep], live.hidden[keep]
        live.rows, live.lengths = [live.rows[j] for j in still], [live.lengths[j] for j in still]

    def _compact(self, live: _Batch) -> None:
        """Gather every row's valid columns to the right of the layout, in both caches."""
        index = compaction_index(live.valid)
        self._edit(live.cache, lambda x: gather_columns(x, index))
        live.dcache[0] = (gather_columns(live.dcache[0][0], index), gather_columns(live.dcache[0][1], index))
        live.valid = live.valid.gather(1, index)
        self.counters.compactions += 1

    @staticmethod
    def _edit(cache: Any, fn: Any) -> None:
        """Apply ``fn`` to every layer's keys and values [B, heads, L, d] of a transformers cache."""
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ContractError(
                    "eagle3-eval's batched cache edits need full-attention layers; this target's "
                    "cache has a sliding-window layer"
                )
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    # -- reference -----------------------------------------------------------------------------

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_new: int, batch_size: int) -> list[Reference]:
        """Plain greedy decoding of the target (the reference for losslessness), batched as
        :meth:`speculative`, recording the top-1/top-2 logit margin at every position."""
        return in_batches(prompts, batch_size, lambda batch: self._greedy_batch(batch, max_new))

    def _greedy_batch(self, prompts: list[list[int]], max_new: int) -> list[Reference]:
        from transformers import DynamicCache

        dev = self.device
        ids, valid = left_pad(prompts, dev)
        padded = len({len(p) for p in prompts}) > 1
        length = valid.sum(1)  # [B]
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits, _ = self.target_forward(ids, positions, valid if padded else None, cache, aux=False, last_only=True)
        out = [Reference([]) for _ in prompts]
        rows = list(range(len(prompts)))
        while True:
            top = logits[:, -1].float().topk(2, dim=-1).values  # [B, 2]
            tok = logits[:, -1].argmax(-1)  # [B]
            host = torch.cat([tok[:, None].float(), top[:, :1] - top[:, 1:]], dim=1).tolist()
            still = []
            for j, (row, (t, margin)) in enumerate(zip(rows, host)):
                out[row].tokens.append(int(t))
                out[row].margins.append(margin)
                if len(out[row].tokens) < max_new and int(t) not in self.eos:
                    still.append(j)
            if not still:
                return out
            if len(still) < len(rows):
                keep = torch.tensor(still, dtype=torch.long, device=dev)
                self._edit(cache, lambda x, keep=keep: x[keep])
                valid, length, tok, rows = valid[keep], length[keep], tok[keep], [rows[j] for j in still]
            valid = torch.cat([valid, valid.new_ones(len(rows), 1)], dim=1)
            logits, _ = self.target_forward(tok[:, None], length[:, None], valid if padded else None, cache, aux=False)
            length = length + 1
