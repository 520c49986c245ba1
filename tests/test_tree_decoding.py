"""Tree drafts (eagle3_train.evaluation.tree) against independent references: the EAGLE-2 expansion
against a loop that runs the draft along every candidate's path alone; the tree attention mask and
positions against a dense mask built from parent pointers by brute force; the target's tree forward
against plain forwards of every node's path; the accepted path against a hand-worked tree.
(End to end -- lossless, batch-invariant, topk=1 = the chain -- with a trained draft: test_export_eval.)"""

import copy
import random

import pytest
import torch

from eagle3_train.core.errors import ConfigError
from eagle3_train.evaluation.decoding import SpecDecoder, extend_mask, left_pad, position_masks
from eagle3_train.evaluation.eval import EvalConfig, acceptance_by_position, looping_warnings, repeated_tokens
from eagle3_train.evaluation.tree import DraftTree, TreeShape, accept_path, ancestor_matrix, propose_tree
from eagle3_train.targets.tiny import build_tiny_model, tiny_config
from test_draft_cache import model  # noqa: F401 (the random draft fixture)


@pytest.fixture(scope="module")
def draft(model):  # noqa: F811 (the fixture)
    """test_draft_cache's random head (draft vocab 48) with a one-to-one d2t, so that a path of
    target ids names one path of draft ids."""
    m = copy.deepcopy(model)
    m.d2t.copy_(3 * torch.arange(m.d2t.numel()))  # draft id i -> target id 4i, not the identity
    return m


def path_of(parents: list[int], tokens: list[int], i: int) -> tuple[int, ...]:
    """The tokens from the root's child down to node i, walking parent pointers."""
    path = []
    while parents[i] >= 0:
        path.append(tokens[i])
        i = parents[i]
    return tuple(reversed(path))


def reference_tree(draft, aux, ids, topk, steps, n):
    """EAGLE-2 for one row by loops: every candidate's log-probability from the draft run along that
    candidate's own path alone (batch 1, a fresh cache each, the chain's steps), frontiers and the
    rerank by Python's sort. Returns {path of target ids: cumulative log-probability} of the kept."""
    t = aux.shape[0]

    def after(path):
        cache = []
        h = draft.step(draft.fuse(aux[None]), ids[None, 1:], torch.arange(t)[None], cache, 0)[:, -1]
        for j, token in enumerate(path):
            h = draft.step(h[:, None], torch.tensor([[token]]), torch.tensor([[t + j]]), cache, j + 1)[:, 0]
        return torch.log_softmax(draft.logits(h)[0].float(), -1)

    frontier, candidates = [((), 0.0)], []
    for _ in range(steps):
        children = []
        for path, score in frontier:
            values, idx = after(path).topk(topk)
            children += [(path + (int(draft.to_target(d)),), score + float(v)) for v, d in zip(values, idx)]
        candidates += children
        frontier = sorted(children, key=lambda c: -c[1])[:topk]
    return dict(sorted(candidates, key=lambda c: -c[1])[: n - 1])


@pytest.mark.parametrize("topk,steps,n", [(3, 3, 10), (2, 4, 12), (4, 2, 21)])
def test_expansion_equals_the_draft_run_along_each_path_alone(draft, topk, steps, n):
    """Two left-padded rows: the batched expansion (frontier steps in one call, earlier steps'
    cache entries gathered to each node's ancestors) keeps the nodes the loop keeps, with the same
    scores -- which a wrong gather would change -- in topological order, closed under ancestors."""
    torch.manual_seed(topk)
    rows = [(torch.randn(t, 3 * 64), torch.randint(0, 256, (t + 1,))) for t in (9, 5)]
    width = 9
    aux = torch.zeros(2, width, 3 * 64)
    nxt = torch.zeros(2, width, dtype=torch.long)
    for i, (a, ids) in enumerate(rows):
        aux[i, width - len(a) :], nxt[i, width - len(a) :] = a, ids[1:]
    valid = left_pad([[1] * len(a) for a, _ in rows], torch.device("cpu"))[1]
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = []
    with torch.no_grad():
        hidden = draft.step(draft.fuse(aux), nxt, pos, cache, 0, extend_mask(valid[:, :0], valid))[:, -1]
        root = torch.tensor([ids[-1] for _, ids in rows])
        tree = propose_tree(draft, hidden, root, valid.sum(1) - 1, cache, TreeShape(topk, n), steps, valid)
        want = [reference_tree(draft, a, ids, topk, steps, n) for a, ids in rows]
    assert tree.tokens.shape == (2, n) and tree.tokens[:, 0].tolist() == root.tolist()
    for b in range(2):
        parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))  # parents first: closed, ordered
        got = {path_of(parents, tokens, i): s for i, s in enumerate(tree.scores[b].tolist()) if i}
        assert set(got) == set(want[b])
        for path, score in want[b].items():
            assert got[path] == pytest.approx(score, abs=1e-4)
        assert [len(path_of(parents, tokens, i)) for i in range(n)] == tree.depths[b].tolist()


def brute_mask(valid, parents, length, window):
    """The dense [B, T, L+T] visibility of a tree's nodes, one entry at a time: context column c is
    seen when valid (and, with a window, its token position is within it); node j by node i when a
    walk up i's parent pointers meets j."""
    b, width = valid.shape
    t = len(parents[0])
    out = torch.zeros(b, t, width + t, dtype=torch.bool)
    depth = [[len(path_of(p, list(range(t)), i)) for i in range(t)] for p in parents]
    for r in range(b):
        ctx_pos = [sum(valid[r, : c + 1].tolist()) - 1 for c in range(width)]
        for i in range(t):
            q = length[r] + depth[r][i]
            for c in range(width):
                out[r, i, c] = bool(valid[r, c]) and (window is None or ctx_pos[c] > q - window)
            j = i
            while j >= 0:
                out[r, i, width + j] = window is None or length[r] + depth[r][j] > q - window
                j = parents[r][j]
    return out, torch.tensor(depth)


@pytest.mark.parametrize("window", [None, 4])
def test_tree_mask_and_positions_equal_a_dense_reference(window):
    parents = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 2, 3, 0, 5, 0]]  # a bushy tree and a chain with side shoots
    valid = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # padding, a hole
    length = valid.sum(1)
    tree = DraftTree(
        torch.zeros(2, 8, dtype=torch.long),
        torch.tensor(parents),
        torch.zeros(2, 8, dtype=torch.long),
        torch.zeros(2, 8),
    )
    want, depth = brute_mask(valid, parents, length.tolist(), window)
    positions = length[:, None] + depth
    assert positions[0].tolist() == [5, 6, 6, 7, 7, 7, 8, 9]  # siblings share a position
    anc = tree.ancestors()
    assert torch.equal(anc, brute_mask(valid, parents, length.tolist(), None)[0][:, :, valid.shape[1] :])
    got = position_masks(
        torch.cat([valid, torch.ones(2, 8, dtype=torch.bool)], 1), positions, window, None, torch.float32, anc
    )
    assert got.shape == (2, 1, 8, 16)
    assert torch.equal(got[:, 0] == 0, want)
    if window:  # mixed layer types: one mask per type, the full one without the window
        both = position_masks(
            torch.cat([valid, torch.ones(2, 8, dtype=torch.bool)], 1),
            positions,
            window,
            ["full_attention", "sliding_attention"],
            torch.float32,
            anc,
        )
        assert torch.equal(both["sliding_attention"], got)
        assert torch.equal(both["full_attention"][:, 0] == 0, brute_mask(valid, parents, length.tolist(), None)[0])


def test_ancestor_matrix_of_a_deep_chain():
    parents = torch.tensor([[-1] + list(range(11))])
    assert torch.equal(ancestor_matrix(parents)[0], torch.ones(12, 12, dtype=torch.bool).tril())


@pytest.mark.parametrize("name,lengths", [("tiny", (7, 4)), ("tiny:gpt_oss", (40, 31))])
def test_target_tree_forward_equals_plain_forwards_of_each_path(name, lengths):
    """Two left-padded prompts in the cache, then one forward over hand-built trees: every node's
    logits and hidden states are those of a plain, cache-free forward over the prompt, the root and
    the node's path (the tree's other branches unseen, RoPE at the path's positions). gpt-oss: its
    sliding-window layers (window 32, prompts longer) count the window in the path's tokens."""
    from transformers import DynamicCache

    torch.manual_seed(3)
    target = build_tiny_model(tiny_config(name)).float().eval()
    with torch.no_grad():  # sharp attention: a wrongly visible key or position would show
        for layer in target.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    dec = SpecDecoder(target, None, [1, 2, 3], 3, set())
    assert (dec.window is not None) == (name == "tiny:gpt_oss")
    prompts = [torch.randint(0, 250, (n,)).tolist() for n in lengths]
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, 0]])
    tokens = torch.randint(0, 250, (2, 7))
    ids, valid = left_pad(prompts, torch.device("cpu"))
    length = valid.sum(1)
    cache = DynamicCache()
    depths = torch.tensor([[len(path_of(p, list(range(7)), i)) for i in range(7)] for p in parents.tolist()])
    with torch.no_grad():
        dec.target_forward(ids, (valid.long().cumsum(1) - 1).clamp(min=0), valid, cache, aux=False)
        logits, states = dec.target_forward(
            tokens,
            length[:, None] + depths,
            torch.cat([valid, torch.ones(2, 7, dtype=torch.bool)], 1),
            cache,
            aux=True,
            tree=ancestor_matrix(parents),
        )
        for b in range(2):
            for i in range(7):
                seq = prompts[b] + [int(tokens[b, 0])] + list(path_of(parents[b].tolist(), tokens[b].tolist(), i))
                out = target(torch.tensor([seq]), output_hidden_states=True)
                torch.testing.assert_close(logits[b, i], out.logits[0, -1], atol=1e-4, rtol=1e-4)
                want = torch.cat([out.hidden_states[k][0, -1] for k in (1, 2, 3)])
                torch.testing.assert_close(states[b, i], want, atol=1e-4, rtol=1e-4)


def test_accepted_path_follows_the_targets_choices():
    """Root 0 -> children 1 (token 5), 2 (token 6); 1 -> 3 (7), 4 (8); 3 -> 5 (9); 2 -> 6 (4)."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2]] * 3)
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9, 4]] * 3)
    tree = DraftTree(tokens, parents, torch.tensor([[0, 1, 1, 2, 2, 3, 2]] * 3), torch.zeros(3, 7))
    greedy = torch.tensor(
        [
            [5, 8, 0, 0, 2, 0, 0],  # root wants 5 (node 1), node 1 wants 8 (node 4), node 4 wants 2: none -> a=2
            [6, 0, 4, 0, 0, 0, 3],  # the other branch: 2 then 6 -> a=2
            [5, 7, 0, 9, 0, 0, 0],  # down to the deepest node 5 -> a=3
        ]
    )
    refused = torch.zeros(3, 7, dtype=torch.bool)
    a, path = accept_path(tree, greedy, refused, 3)
    assert a.tolist() == [2, 2, 3]
    assert path.tolist() == [[0, 1, 4, 4], [0, 2, 6, 6], [0, 1, 3, 5]]
    refused[2, 3] = True  # node 3 is an eos draft: never accepted, the target's own token takes over
    a, path = accept_path(tree, greedy, refused, 3)
    assert a[2] == 1 and path[2].tolist() == [0, 1, 1, 1]


def test_tau_by_reply_position_regroups_the_steps():
    """Bucket 4: steps start at positions 1, 4, 5, 9, 11 (the first token is the prefill's)."""
    got = acceptance_by_position([[2, 0, 3, 1, 4], [5]], 5, 4)
    assert [(b["from"], b["to"], b["verify_steps"], b["tokens"]) for b in got] == [
        (0, 4, 2, 9),
        (4, 8, 2, 5),
        (8, 16, 2, 7),
    ]
    assert [b["tau"] for b in got] == [4.5, 2.5, 3.5]
    assert all("repeated_share" not in b for b in got)


def repeats_by_search(tokens, n):
    """Brute force: token i repeats when tokens[i-n+1 : i+1] occurs as a slice starting before i-n+1."""
    return [
        i >= n - 1 and any(tokens[j : j + n] == tokens[i - n + 1 : i + 1] for j in range(i - n + 1))
        for i in range(len(tokens))
    ]


def test_repeated_tokens_mark_where_a_reply_loops():
    assert repeated_tokens(list(range(1, 9)) * 2) == [False] * 15 + [True]  # only the second run's last token
    assert repeated_tokens([7] * 10) == [False] * 8 + [True] * 2  # overlapping runs count
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        for n in (1, 3, 8):
            assert repeated_tokens(tokens, n) == repeats_by_search(tokens, n)


def test_tau_by_reply_position_says_how_much_of_each_stretch_repeats():
    """Bucket 4, two replies: the first runs its first 8 tokens again (its 16th token closes a repeated
    run of 8), the second never repeats; the share is per token at its own position, beside the steps'
    figures (unchanged)."""
    loop, fresh = [1, 2, 3, 4, 5, 6, 7, 8] * 2, list(range(20, 30))
    steps = [[2, 0, 3, 1, 4], [5]]
    got = acceptance_by_position(steps, 5, 4, [loop, fresh])
    added = {"repeated_share", "tokens_at_positions"}
    assert [{key: v for key, v in b.items() if key not in added} for b in got] == acceptance_by_position(steps, 5, 4)
    flags = {p: [] for p in ((0, 4), (4, 8), (8, 16))}
    for reply in (loop, fresh):
        for i, r in enumerate(repeats_by_search(reply, 8)):
            flags[next(e for e in flags if e[0] <= i < e[1])].append(r)
    assert [b["repeated_share"] for b in got] == [sum(f) / len(f) for f in flags.values()] == [0.0, 0.0, 1 / 10]
    assert [b["tokens_at_positions"] for b in got] == [len(f) for f in flags.values()] == [8, 8, 10]
    assert looping_warnings(got) == []
    stretch = {"from": 256, "to": 512, "tau": 4.8, "repeated_share": 0.85, "tokens_at_positions": 3593}
    assert looping_warnings([stretch, stretch | {"repeated_share": 0.49}]) == [
        "reply positions 256-512: 85% of the 3593 tokens there repeat a run of 8 from earlier in the same reply "
        "(the target loops); tau 4.80 there measures the draft copying the loop, not predicting new text"
    ]


def test_tree_options_are_checked():
    base = dict(draft="x", prompts="y")
    assert EvalConfig(**base).tree is None and EvalConfig(**base, num_steps=3, num_draft_tokens=4).depth == 3
    assert EvalConfig(**base, topk=4, num_steps=3, num_draft_tokens=16).tree == TreeShape(4, 16)
    with pytest.raises(ConfigError, match="topk=4 drafts a tree: give num_draft_tokens"):
        EvalConfig(**base, topk=4)
    with pytest.raises(
        ConfigError,
        match=r"num_draft_tokens=38 must be 2..37: the root plus at most topk \+ "
        r"\(num_steps-1\)\*topk\^2 = 36 candidates",
    ):
        EvalConfig(**base, topk=4, num_steps=3, num_draft_tokens=38)
    with pytest.raises(ConfigError, match="with topk=1 the draft is the chain of num_steps=5 tokens"):
        EvalConfig(**base, num_draft_tokens=8)
    with pytest.raises(ConfigError, match="position_bucket must be positive"):
        EvalConfig(**base, position_bucket=0)
