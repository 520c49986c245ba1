"""Tree drafts (EAGLE-2 style, as SGLang builds them): expansion, rerank, tree attention, acceptance.

A round drafts a tree per row instead of a chain. Node 0 is the root, the row's last accepted token
(the target's own, not yet in its cache); a node at depth d >= 1 is a draft token at position
``length + d``. The draft grows the tree ``num_steps`` levels deep:

- depth 1: the ``topk`` most likely tokens after the root (one draft distribution);
- each later level: every one of the ``topk`` frontier nodes runs one draft step (all of them in
  one call) and proposes its own ``topk`` children; a child scores its parent's score plus its draft
  log-probability (the log of SGLang's product of probabilities), and the ``topk`` best children of
  the level become the next frontier;
- rerank: of all the candidates (``topk + (num_steps - 1) * topk**2``) the ``num_draft_tokens - 1``
  best by score are kept (SGLang counts the root among its ``--speculative-num-draft-tokens``).

A child never scores above its parent (a log-probability is <= 0) and ties rank the shallower node
first (a stable sort over candidates listed level by level), so the kept nodes are closed under
ancestors: every kept node's parent is kept. With ``topk=1`` the tree is the greedy chain of
``num_steps`` tokens that :meth:`Eagle3Draft.propose` drafts.

The draft's frontier step is :meth:`Eagle3Draft.step` as the chain runs it: its earlier steps'
keys are visible on the "diagonal" only (TTT's key pattern). For a tree the diagonal must be the
node's own ancestors, so after each level the earlier steps' cache entries are gathered by the new
frontier's parent slot: slot i then holds, at every step, the ancestor of frontier node i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3_train.core.errors import ConfigError
from eagle3_train.model import Eagle3Draft


def tree_candidates(topk: int, num_steps: int) -> int:
    """How many draft tokens the expansion proposes before the rerank: ``topk`` at depth 1 and
    ``topk**2`` at each deeper level."""
    return topk + (num_steps - 1) * topk * topk


@dataclass(frozen=True)
class TreeShape:
    """A tree draft's settings beside its depth (the decoder's ``k``, SGLang's num_steps).

    Args:
        topk: children expanded per frontier node, and the frontier's width
            (SGLang ``--speculative-eagle-topk``).
        num_draft_tokens: nodes verified per round, the root (the last accepted token) included
            (SGLang ``--speculative-num-draft-tokens``).
    """

    topk: int
    num_draft_tokens: int

    def check(self, num_steps: int) -> None:
        """Refuse settings no tree of depth ``num_steps`` can have, naming the options."""
        if self.topk < 1 or num_steps < 1:
            raise ConfigError(f"topk and num_steps must be positive, got topk={self.topk}, num_steps={num_steps}")
        most = 1 + tree_candidates(self.topk, num_steps)
        if not 2 <= self.num_draft_tokens <= most:
            raise ConfigError(
                f"num_draft_tokens={self.num_draft_tokens} must be 2..{most}: the root plus at most topk + "
                f"(num_steps-1)*topk^2 = {most - 1} candidates (topk={self.topk}, num_steps={num_steps})"
            )


@dataclass
class DraftTree:
    """One round's trees, one per row, nodes in topological order (a parent before its children).

    ``tokens`` [B, N] target ids (node 0: the root), ``parents`` [B, N] node indices (root: -1),
    ``depths`` [B, N] (root: 0), ``scores`` [B, N] cumulative draft log-probabilities (root: 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: entry (i, j) when node j is node i or one of its ancestors -- the tree
        attention pattern among the nodes (each sees its own path to the root)."""
        return ancestor_matrix(self.parents)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parent indices (-1: none) -> [B, N, N] bool, (i, j) when j is i or an ancestor of i.
    Walks every node up one level at a time (at most N-1 levels)."""
    b, n = parents.shape
    out = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    up = parents  # [B, N] each node's ancestor `step` levels up (-1: past the root)
    for _ in range(n - 1):
        has = up >= 0
        if not has.any():
            break
        out |= F.one_hot(up.clamp(min=0), n).bool() & has[..., None]
        up = torch.where(has, parents.gather(1, up.clamp(min=0)), up)
    return out


def _children(draft: Eagle3Draft, hidden: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` most likely next tokens after each hidden state [..., H]: their draft
    log-probabilities [..., topk] (fp32, <= 0) and target ids [..., topk]."""
    logp = torch.log_softmax(draft.logits(hidden).float(), dim=-1)
    values, ids = logp.topk(topk, dim=-1)
    # a log-probability is <= 0 in exact arithmetic; clamp rounding so that no child outscores its parent
    return values.clamp(max=0.0), draft.to_target(ids)


def propose_tree(
    draft: Eagle3Draft,
    hidden: torch.Tensor,
    root: torch.Tensor,
    positions: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    shape: TreeShape,
    num_steps: int,
    mask: torch.Tensor | None = None,
) -> DraftTree:
    """Draft one tree per row (see the module docstring).

    Args:
        hidden: step 0's output [B, H] at each row's last context position ``positions`` [B].
        root: [B] the root tokens (the rows' last accepted tokens).
        cache: the draft's cache, ``cache[0]`` the step-0 keys/values of the context; the frontier
            steps append theirs (dropped by the next round's step 0, as a chain's are).
        mask: [B, T_k] which step-0 columns each row sees (None: all).
    """
    k, b, dev = shape.topk, hidden.shape[0], hidden.device
    scores, tokens = _children(draft, hidden, k)  # [B, K] depth 1
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((b, k), -1, dtype=torch.long, device=dev)]  # candidate index of the parent (-1: root)
    cand_depths = [torch.ones(k, dtype=torch.long, device=dev)]
    frontier = torch.arange(k, device=dev).expand(b, k)  # [B, K] candidate index of each frontier node
    front_scores, front_tokens = scores, tokens
    h = hidden[:, None].expand(b, k, hidden.shape[-1])  # [B, K, H] the frontier's parents' outputs
    if mask is not None:  # every frontier node sees the row's context columns
        mask = mask[:, None].expand(b, k, mask.shape[-1])
    elif k > 1:  # None would be lower-right causal, hiding context columns from all but the last query
        mask = torch.ones(b, k, cache[0][0].shape[2], dtype=torch.bool, device=dev)
    offset = k
    for j in range(1, num_steps):
        pos = (positions + j)[:, None].expand(b, k)
        out = draft.step(h, front_tokens, pos, cache, j, mask)  # [B, K, H] the frontier's own outputs
        logp, toks = _children(draft, out, k)  # [B, K, K]
        child_scores = (front_scores[:, :, None] + logp).flatten(1)  # [B, K*K], children of slot s at s*K..
        cand_scores.append(child_scores)
        cand_tokens.append(toks.flatten(1))
        cand_parents.append(frontier[:, :, None].expand(b, k, k).flatten(1))
        cand_depths.append(torch.full((k * k,), j + 1, dtype=torch.long, device=dev))
        if j + 1 < num_steps:  # the next frontier: the level's best topk children
            pick = torch.sort(child_scores, dim=1, descending=True, stable=True).indices[:, :k]  # [B, K]
            slot = pick // k  # the parent's frontier slot
            front_scores, front_tokens = child_scores.gather(1, pick), toks.flatten(1).gather(1, pick)
            frontier = offset + pick
            h = out.gather(1, slot[..., None].expand(b, k, out.shape[-1]))
            # steps 1..j's entries to the new frontier's ancestors: [B, nkv, K, d] gathered along K
            idx = slot[:, None, :, None]
            cache[1:] = [(kk.gather(2, idx.expand_as(kk)), vv.gather(2, idx.expand_as(vv))) for kk, vv in cache[1:]]
        offset += k * k
    all_scores = torch.cat(cand_scores, dim=1)  # [B, M] candidates level by level
    # the best num_draft_tokens-1; a stable sort ranks ties level by level, so parents first
    kept = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, : shape.num_draft_tokens - 1]
    kept = torch.sort(kept, dim=1).values  # [B, N-1] in candidate order: every parent before its children
    n = kept.shape[1] + 1
    node_of = torch.full_like(all_scores, -1, dtype=torch.long)  # [B, M] candidate -> node index
    node_of.scatter_(1, kept, torch.arange(1, n, device=dev).expand(b, n - 1))
    parent_cand = torch.cat(cand_parents, dim=1).gather(1, kept)  # [B, N-1]
    parents = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
    zeros = torch.zeros(b, 1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.cat([root[:, None], torch.cat(cand_tokens, dim=1).gather(1, kept)], dim=1),
        parents=torch.cat([zeros - 1, parents], dim=1),
        depths=torch.cat([zeros, torch.cat(cand_depths).expand(b, -1).gather(1, kept)], dim=1),
        scores=torch.cat([zeros.float(), all_scores.gather(1, kept)], dim=1),
    )


def accept_path(
    tree: DraftTree, greedy: torch.Tensor, refused: torch.Tensor, num_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest root path whose every node is the target's greedy choice after its parent.

    ``greedy`` [B, N] the target's token after each node (its verify logits' argmax), ``refused``
    [B, N] nodes never accepted (eos drafts: the target's own token ends the reply). Returns the
    accepted draft count ``a`` [B] and the path's node indices [B, num_steps+1] (the root first; past
    ``a`` the last accepted node repeats). Of matching siblings (equal tokens, only with a d2t map
    that is not one-to-one) the first is taken.
    """
    ok = (tree.tokens == greedy.gather(1, tree.parents.clamp(min=0))) & ~refused  # [B, N]
    ok[:, 0] = False  # the root is nobody's child
    cur = torch.zeros(tree.tokens.shape[0], dtype=torch.long, device=greedy.device)
    a = torch.zeros_like(cur)
    path = [cur]
    for _ in range(num_steps):
        child = ok & (tree.parents == cur[:, None])  # [B, N] accepted children of the current node
        found = child.any(1)
        cur = torch.where(found, child.long().argmax(1), cur)  # argmax: the first one
        a = a + found.long()
        path.append(cur)
    return a, torch.stack(path, dim=1)
