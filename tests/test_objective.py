"""The objective's pure functions on hand-built inputs."""

import math

import numpy as np
import pytest
import torch

from eagle3_train.core.errors import ConfigError
from eagle3_train.training.objective import (
    Objective,
    acceptance_length,
    accuracies,
    correct_predictions,
    decode_walk,
    lk_loss,
    mixed_loss,
    soft_cross_entropy,
    step_weights,
    target_distribution,
)


def test_target_distribution_restricts_and_renormalises():
    # target vocab 5, draft vocab = {1, 3, 4}; lm_head = identity so logits = last_hidden
    t2d = torch.tensor([False, True, False, True, True])
    hidden = torch.tensor(
        [
            [0.0, 2.0, 1.0, 0.0, 0.0],  # argmax 1 -> draft 0
            [5.0, 1.0, 0.0, 1.0, 0.0],  # argmax 0 -> outside
            [0.0, 0.0, 0.0, 0.0, 3.0],
        ]
    )  # argmax 4 -> draft 2
    probs, argmax, ok = target_distribution(hidden, torch.eye(5), t2d, chunk=2)
    e = math.e
    torch.testing.assert_close(probs[0], torch.tensor([e**2, 1.0, 1.0]) / (e**2 + 2))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert argmax.tolist() == [0, -1, 2] and ok.tolist() == [True, False, True]


def test_soft_cross_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0], [9.0, -9.0]])
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([True, True, False])
    # row 0: q = [1/4, 3/4] -> -(0.5 log 1/4 + 0.5 log 3/4); row 1: q = [1/2, 1/2] -> log 2
    want = (-(0.5 * math.log(0.25) + 0.5 * math.log(0.75)) + math.log(2.0)) / 2
    assert soft_cross_entropy(logits, p, mask).item() == pytest.approx(want, rel=1e-6)
    assert soft_cross_entropy(logits, p, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_lk_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0], [9.0, -9.0]])
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([True, True, False])
    # row 0: q = [1/4, 3/4] -> min sums to 1/4 + 1/2 = 3/4; row 1: q = [1/2, 1/2] -> 1/2
    want = (-math.log(0.75) - math.log(0.5)) / 2
    assert lk_loss(logits, p, mask).item() == pytest.approx(want, rel=1e-6)
    both = mixed_loss(logits, p, mask, lk_weight=0.25)
    assert both.item() == pytest.approx(0.75 * soft_cross_entropy(logits, p, mask).item() + 0.25 * want, rel=1e-6)
    assert mixed_loss(logits, p, mask).item() == soft_cross_entropy(logits, p, mask).item()
    # q = p: every draft token is accepted, nothing to learn
    assert lk_loss(p.clamp(min=1e-9).log()[:2], p[:2], mask[:2]).item() == pytest.approx(0.0, abs=1e-6)


def test_objective_smooths_and_leaves_out_unsure_positions():
    p = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]])
    o = Objective(label_smoothing=0.2, min_target_prob=0.5)
    torch.testing.assert_close(o.smooth(p)[0], torch.tensor([0.77, 0.13, 0.05, 0.05]))
    torch.testing.assert_close(o.smooth(p).sum(-1), torch.ones(2))
    assert o.loss_mask(p.max(-1).values, torch.tensor([True, True])).tolist() == [True, False]
    assert Objective().smooth(p) is p and Objective().loss_mask(None, torch.tensor([False])).tolist() == [False]
    with pytest.raises(ConfigError, match=r"objective.lk_weight must be in \[0, 1\]"):
        Objective(lk_weight=1.5)


def test_accuracy_weights_and_acceptance():
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    hit, in_vocab, n = correct_predictions(
        logits.argmax(-1), torch.tensor([1, 1, 1, -1]), torch.tensor([True, True, True, False])
    ).tolist()
    assert (hit, in_vocab, n) == (2, 3, 3)
    assert step_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])
    assert acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert acceptance_length([]) == 1.0


def test_out_of_vocab_argmax_counts_as_a_miss():
    """A loss-masked position whose target argmax lies outside the draft vocab is in the honest
    denominator as a miss (the draft can never propose that token); acc_in_vocab leaves it out."""
    t2d = torch.tensor([False, True, False, True, True])  # draft vocab = target ids {1, 3, 4}
    hidden = torch.tensor(
        [
            [0.0, 2.0, 0.0, 0.0, 0.0],  # target argmax 1 -> draft 0
            [3.0, 0.0, 0.0, 1.0, 0.0],  # target argmax 0 -> outside
            [0.0, 0.0, 0.0, 0.0, 3.0],  # target argmax 4 -> draft 2
            [0.0, 0.0, 4.0, 0.0, 1.0],  # target argmax 2 -> outside
            [0.0, 0.0, 0.0, 5.0, 0.0],
        ]
    )  # target argmax 3 -> draft 1, not loss-masked
    _, argmax, _ = target_distribution(hidden, torch.eye(5), t2d)
    # the draft's picks: draft 0 (hit), draft 0 (its best in-vocab guess at an out-of-vocab
    # position: a miss), draft 1 (miss), draft 2 (out of vocab: miss), draft 1 (not counted)
    draft = torch.tensor([0, 0, 1, 2, 1])
    mask = torch.tensor([True, True, True, True, False])
    counts = correct_predictions(draft, argmax, mask)
    assert counts.tolist() == [1, 2, 4]
    # a second step where the draft is right wherever it can be: honest accuracy = coverage 2/4
    perfect = torch.tensor([0, 1, 2, 0, 1])
    both = np.stack([counts.numpy(), correct_predictions(perfect, argmax, mask).numpy()])
    honest, in_vocab = accuracies(both)
    assert honest == [0.25, 0.5] and in_vocab == [0.5, 1.0]
    assert acceptance_length(honest) == pytest.approx(1 + 0.25 + 0.25 * 0.5)
    assert accuracies(np.zeros((1, 3))) == ([0.0], [0.0])


def test_decode_walk_counts_verify_steps_as_decoding_does():
    """Hand-walked rows: a reply's first token is the prefill's and its last (the end of turn) the
    target's, since eagle3-eval never accepts an end-of-turn draft; each verify step accepts the
    leading hits of the chain at its start (capped at k and before the reply's last token) and
    counts accepted + 1."""
    k, t = 3, 16
    answer = np.zeros(t, bool)
    answer[2:15] = True  # one reply: its first token at 2, then 12 tokens at 3..14 (14: the end of turn)
    assert decode_walk(np.ones((k, t), bool), answer) == (12, 3)  # 3..6, 7..10, 11..14
    assert decode_walk(np.zeros((k, t), bool), answer) == (12, 12)
    hits = np.zeros((k, t), bool)
    hits[:, 1] = True  # step 1 (chain at 1) accepts 3, 4, 5; the target adds 6
    hits[0, 5] = hits[1, 5] = True  # step 2 (chain at 5): 7, 8, then a miss at 9, the target's
    hits[:, 7] = True  # never drafted: no step starts at 7
    hits[:, 10] = True  # steps 3 and 4 (chains at 8, 9) miss; step 5 (at 10) accepts 12, 13; the target adds 14
    assert decode_walk(hits, answer) == (4 + 3 + 1 + 1 + 3, 5)
    short = np.zeros(t, bool)
    short[2:12] = True
    assert decode_walk(np.ones((5, t), bool), short) == (6 + 3, 2)  # k=5: 3..8, then 9, 10 and the end of turn
    two = np.zeros(t, bool)
    two[1:4] = two[8:12] = True  # two replies: 2 and the end 3 after 1; 9, 10 and the end 11 after 8
    assert decode_walk(np.ones((k, t), bool), two) == (2 + 3, 2)
    assert decode_walk(np.ones((k, t), bool), np.zeros(t, bool)) == (0, 0)
