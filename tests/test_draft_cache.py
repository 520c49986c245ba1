"""The draft's inference path (step 0 extended over new positions with a cache, then the chain)
against training's unroll: the same logits at every TTT step, for rows of a padded batch too."""

import pytest
import torch

from eagle3_train.model.draft import DraftConfig, Eagle3Draft
from eagle3_train.targets.tiny import tiny_config

K = 4  # TTT steps / chain length


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Eagle3Draft(DraftConfig.from_target(tiny_config(), num_aux=3, draft_vocab_size=48)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
        m.d2t.copy_(torch.randint(0, 200, (48,)))
    return m


def unroll_logits(model, aux, ids):
    """Training's view: logits [K, T, V] of TTT steps 0..K-1 at every position of one row."""
    with torch.no_grad():
        return torch.stack([model.logits(out)[0] for out in model.unroll(aux[None], ids[None], K)])


def inference_logits(model, rows, chunks):
    """Inference's view for a batch of rows (aux [T_b, n*H], ids [T_b + K]): step 0 over each row's
    first ``chunks[0][b]`` positions, then over the rest, left-padded and with junk columns after a
    row's end (as a verify round leaves them); then chain steps 1..K-1 fed with the row's own next
    tokens. Masks are written out column by column. Returns logits [B, K, V] at each row's last position."""
    b = len(rows)
    cache, valid = [], torch.zeros(b, 0, dtype=torch.bool)
    hidden_last = None
    for c in range(len(chunks)):
        spans = [(sum(ch[i] for ch in chunks[:c]), sum(ch[i] for ch in chunks[: c + 1])) for i in range(b)]
        width = max(e - s for s, e in spans) + 1  # one junk column at least
        aux = torch.zeros(b, width, rows[0][0].shape[-1])
        nxt = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        new_valid = torch.zeros(b, width, dtype=torch.bool)
        pad_left = c == 0  # the prompt is left-padded; later chunks end with junk columns
        for i, ((a, ids), (s, e)) in enumerate(zip(rows, spans)):
            off = width - (e - s) if pad_left else 0
            aux[i, off : off + e - s] = a[s:e]
            nxt[i, off : off + e - s] = ids[s + 1 : e + 1]
            pos[i, off : off + e - s] = torch.arange(s, e)
            new_valid[i, off : off + e - s] = True
            aux[i, :off] = torch.randn(off, aux.shape[-1])  # junk, never seen
            aux[i, off + e - s :] = torch.randn(width - off - (e - s), aux.shape[-1])
        old = valid.shape[1]
        mask = torch.zeros(b, width, old + width, dtype=torch.bool)
        all_valid = torch.cat([valid, new_valid], 1)
        for i in range(b):
            for q in range(width):
                for col in range(old + width):
                    mask[i, q, col] = (all_valid[i, col] and col <= old + q) or col == old + q
        with torch.no_grad():
            out = model.step(model.fuse(aux), nxt, pos, cache, 0, mask)
        last = [int(new_valid[i].nonzero().max()) for i in range(b)]
        hidden_last = out[torch.arange(b), last]
        valid = all_valid
    ends = [sum(ch[i] for ch in chunks) - 1 for i in range(b)]  # each row's last position t
    logits = [model.logits(hidden_last)]
    hidden = hidden_last
    with torch.no_grad():
        for j in range(1, K):
            tok = torch.stack([ids[t + 1 + j] for (_, ids), t in zip(rows, ends)])
            pos = torch.tensor(ends) + j
            hidden = model.step(hidden[:, None], tok[:, None], pos[:, None], cache, j, valid[:, None])[:, 0]
            logits.append(model.logits(hidden))
    return torch.stack(logits, 1)


def test_chain_with_cache_equals_training_unroll_at_every_step(model):
    torch.manual_seed(1)
    lengths = [9, 14, 5]
    rows = [(torch.randn(t, 3 * 64), torch.randint(0, 256, (t + K,))) for t in lengths]
    chunks = [[6, 9, 2], [3, 5, 3]]  # two rounds of step 0, uneven per row
    got = inference_logits(model, rows, chunks)
    for i, (aux, ids) in enumerate(rows):
        want = unroll_logits(model, aux, ids)[:, lengths[i] - 1]  # [K, V] at the row's last position
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_propose_is_the_unroll_fed_its_own_tokens(model):
    """``propose`` (batch 1, no mask: the path batch-1 eval takes) returns the tokens whose
    embeddings, fed to the training unroll, reproduce its choices step by step."""
    torch.manual_seed(2)
    t = 11
    aux, ids = torch.randn(t, 3 * 64), torch.randint(0, 256, (t + 1,))
    cache = []
    with torch.no_grad():
        h = model.step(model.fuse(aux[None, :7]), ids[None, 1:8], torch.arange(7)[None], cache, 0)
        h = model.step(model.fuse(aux[None, 7:]), ids[None, 8:], torch.arange(7, t)[None], cache, 0)[:, -1]
        drafts = model.propose(h, torch.tensor([t - 1]), cache, K)[0]
    fed = torch.cat([ids, drafts[:-1]])  # token t+1+j is draft j for steps j >= 1
    want = unroll_logits(model, aux, fed)[:, t - 1].argmax(-1)  # [K] draft-vocab ids
    assert drafts.tolist() == model.to_target(want).tolist()
    assert (model.d2t != 0).any()  # the mapping is exercised
