"""regen.batching=graph (data_prep.graph_decode): our static-cache decode loop gives the replies of
transformers' padded ``generate`` (greedy, fp32), for each model family it accepts, and samples
from the distribution it is asked to; what it cannot run it refuses by name."""

from types import SimpleNamespace

import pytest
import torch

from data_prep import graph_decode
from data_prep.graph_decode import GraphDecoder, check_supported
from data_prep.regenerate import RegenConfig, generate_sorted
from eagle3_train.core.errors import ConfigError
from eagle3_train.targets.tiny import build_tiny_model, tiny_config

EOS = [101, 277]  # tokens the tiny model emits early in some replies


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in lengths]


def sharp(model, scale=6.0):
    """The model with its query and key projections scaled up: a random model attends almost
    uniformly, which would hide wrong keys or positions; sharp attention does not."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


def family(model_type):
    """A tiny model of ``model_type`` with the tiny Llama's sizes (Qwen2: biased q/k/v; Qwen3: q/k norms)."""
    import transformers

    base = tiny_config().to_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "pad_token_id",
    )
    kw = {k: base[k] for k in keep}
    if model_type == "qwen3":
        kw["head_dim"] = 24  # not hidden/heads: the decoder must take the config's head_dim
    config = transformers.AutoConfig.for_model(model_type, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_greedy_replies_equal_padded_generate(model_type):
    """Length-sorted batches (the last one short), prompt widths rounded up to 64, replies cut at the
    first end-of-turn token; the same count of replies that hit max_new_tokens."""
    model = sharp(build_tiny_model() if model_type == "llama" else family(model_type))
    ps = prompts((5, 19, 9, 70, 13, 7, 3))
    if model_type != "llama":  # qwen weights end replies elsewhere: take the tokens it emits early as ends
        out = model.generate(torch.tensor([ps[0]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        eos = out[0, len(ps[0]) :].tolist()[3:5]
    else:
        eos = EOS
    padded = generate_sorted(model, ps, RegenConfig(max_new_tokens=24, batch_size=3), eos, 0)
    graph = generate_sorted(model, ps, RegenConfig(max_new_tokens=24, batch_size=3, batching="graph"), eos, 0)
    assert graph == padded
    assert 0 < padded[1] < len(ps) and any(len(r) < 24 for r in padded[0])  # some cut, some at the limit


def test_every_reply_ending_early_stops_the_batch():
    """When every row has ended the loop stops at its next look; the replies are still whole."""
    model = build_tiny_model()
    ps = prompts((5, 6))
    first = generate_sorted(model, ps, RegenConfig(max_new_tokens=1), [], 0)[0]
    eos = sorted({r[0] for r in first})  # each reply's first token ends it
    dec = GraphDecoder(model, 40, eos, 0)
    rows = dec.generate(ps)
    assert [r[0] for r in rows] == [r[0] for r in first] and all(len(r) == 40 for r in rows)


@pytest.mark.parametrize("max_rounds", [0, 16])  # the sort; rejection (top_p 0.8 needs 9 rounds)
def test_sampling_draws_from_the_top_p_distribution(monkeypatch, max_rounds):
    """2000 rows of one prompt: every first token lies in the top-p set of the temperature-scaled
    distribution, and each token's frequency is its renormalised probability (within 5 sd); a tiny
    top_p is greedy; a seed repeats the draws. By sorting and by rejection."""
    monkeypatch.setattr(graph_decode, "TOP_P_MAX_ROUNDS", max_rounds)
    assert (graph_decode.top_p_rounds(0.8) > 0) == (max_rounds > 0)
    model = build_tiny_model()
    p = prompts((12,))[0]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([p])).logits[0, -1] / 0.5, -1)
    sp, order = probs.sort(descending=True)
    keep = int((sp.cumsum(0) - sp < 0.8).sum())  # the top-p set at top_p=0.8
    want = torch.zeros_like(probs)
    want[order[:keep]] = sp[:keep] / sp[:keep].sum()
    assert keep >= 3  # a real choice, not a certainty
    dec = GraphDecoder(model, 1, EOS, 0, do_sample=True, temperature=0.5, top_p=0.8)
    torch.manual_seed(0)
    first = torch.tensor([r[0] for r in dec.generate([p] * 2000)])
    freq = torch.bincount(first, minlength=probs.numel()).double() / 2000
    assert set(first.tolist()) <= set(order[:keep].tolist())
    sd = (want * (1 - want) / 2000).sqrt()
    assert ((freq - want).abs() <= 5 * sd + 1e-9).all()
    greedy = GraphDecoder(model, 8, EOS, 0).generate([p])
    assert GraphDecoder(model, 8, EOS, 0, do_sample=True, temperature=1.0, top_p=1e-6).generate([p]) == greedy
    again = []
    for _ in range(2):
        torch.manual_seed(7)
        again.append(GraphDecoder(model, 8, EOS, 0, do_sample=True, temperature=1.0, top_p=0.95).generate([p] * 4))
    assert again[0] == again[1]


def test_top_p_by_rejection_is_the_nucleus_distribution():
    """A hand-made distribution: the nucleus at top_p 0.7 is the first three tokens (0.4 + 0.25 hold
    0.65 <= 0.7 before the third; 0.8 before the fourth), drawn at 0.4/0.8, 0.25/0.8, 0.15/0.8 over
    40,000 rows (within 5 sd), as sorting cuts it; with one round, the rejected 20 % fall back to
    the argmax. The rounds: 3 for top_p 0.99 (0.01**3 = 1e-6), 4 for 0.97, sorting from 0.968 down
    (5 rounds and more), none at 1."""
    p = torch.tensor([0.04, 0.4, 0.1, 0.25, 0.06, 0.15]).repeat(40_000, 1)
    want = torch.tensor([0, 0.5, 0, 0.3125, 0, 0.1875], dtype=torch.float64)
    assert torch.allclose(graph_decode.top_p_by_sorting(p[:1], 0.7)[0] / 0.8, want.float())
    for rounds, expect in ((30, want), (1, torch.tensor([0, 0.4 + 0.2, 0, 0.25, 0, 0.15], dtype=torch.float64))):
        torch.manual_seed(rounds)
        freq = torch.bincount(graph_decode.top_p_by_rejection(p, 0.7, rounds), minlength=6).double() / len(p)
        sd = (expect * (1 - expect) / len(p)).sqrt()
        assert ((freq - expect).abs() <= 5 * sd + 1e-9).all(), (rounds, freq)
    assert [graph_decode.top_p_rounds(x) for x in (0.99, 0.97, 0.968, 0.5, 0.0, 1.0)] == [3, 4, 0, 0, 0, 0]


def test_unsupported_models_are_refused_by_name():
    moe = SimpleNamespace(config=SimpleNamespace(model_type="mixtral"))
    with pytest.raises(ConfigError, match="not model_type 'mixtral'.*regen.batching=padded"):
        check_supported(moe, 100)
    windowed = SimpleNamespace(config=SimpleNamespace(model_type="mistral", sliding_window=64))
    with pytest.raises(ConfigError, match="sliding window of 64"):
        check_supported(windowed, 100)
    check_supported(windowed, 64)  # within the window: runs
    dynamic = SimpleNamespace(
        config=SimpleNamespace(model_type="llama"),
        model=SimpleNamespace(rotary_emb=SimpleNamespace(rope_type="dynamic")),
    )
    with pytest.raises(ConfigError, match="rope_type 'dynamic' rescales"):
        check_supported(dynamic, 10)


def test_prefill_in_row_slices_changes_nothing(monkeypatch):
    """A prefill split into slices of two rows (a small PREFILL_KV_BYTES, as a large target gets)
    fills the same static cache: the replies equal padded generate's."""
    import data_prep.graph_decode as gd

    model = sharp(build_tiny_model())
    ps = prompts((5, 19, 9, 13, 7))
    dec = GraphDecoder(model, 12, EOS, 0)
    monkeypatch.setattr(gd, "PREFILL_KV_BYTES", dec.kv_bytes_per_token() * 64 * 2 + 1)  # width 64: two rows a slice
    padded = generate_sorted(model, ps, RegenConfig(max_new_tokens=12, batch_size=5), EOS, 0)
    graph = generate_sorted(model, ps, RegenConfig(max_new_tokens=12, batch_size=5, batching="graph"), EOS, 0)
    assert graph == padded


def test_memory_share_is_checked_and_decides_an_output_only_where_it_splits_graph_batches(tmp_path):
    from data_prep.prepare import PrepareConfig, Preparer
    from data_prep.regenerate import RegenConfig

    with pytest.raises(ConfigError, match=r"regen.memory_share must be in \(0, 1\], got 0"):
        RegenConfig(memory_share=0)
    with pytest.raises(ConfigError, match="regen.memory_share"):
        RegenConfig(memory_share=float("nan"))

    def options(**regen):
        cfg = PrepareConfig(target="tiny", input="x.jsonl", out=str(tmp_path), regenerate=True)
        cfg.regen = RegenConfig(**regen)
        return Preparer(cfg)._output_options()

    # the default is not recorded (outputs made before the option existed stay valid), nor a share that
    # splits nothing (padded batches); a graph run's other share is another output (its sampled replies)
    assert "memory_share" not in options(batching="graph")["regen"]
    assert "memory_share" not in options(batching="padded", memory_share=0.2)["regen"]
    assert options(batching="graph", memory_share=0.3)["regen"]["memory_share"] == 0.3
