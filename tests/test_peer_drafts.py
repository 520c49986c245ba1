"""Drafts other frameworks exported, read as they were written (eagle3_train/serving/drafts.py):
speculators 0.9.0, NVIDIA ModelOpt 0.47.0 and SpecForge 0.2.0, each made by that framework's own
export code on a tiny target (tests/fixtures/peers, written by benchmarks/peer_exports.py).

The draft eval builds from each is compared with a plain forward written here from the engines'
llama_eagle3 (vLLM 0.26.0 / SGLang 0.5.17) and the raw tensor names of the file."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_train.core.errors import ContractError
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.serving.check import CheckConfig, ServingConfig, run_check
from eagle3_train.serving.drafts import read_draft_dir
from eagle3_train.serving.loading import load_draft_dir
from eagle3_train.targets import load_target

PEERS = Path(__file__).parent / "fixtures" / "peers"
PROMPTS = ["tell me about rivers", "a story of seven stones", "why is the sky blue", "count to five"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The target the fixtures were exported for, rebuilt from its config and seed."""
    from transformers import AutoConfig

    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

    c = json.loads((PEERS / "target_config.json").read_text())
    config = AutoConfig.for_model(c.pop("model_type"), **c)
    out = tmp_path_factory.mktemp("peer_target") / "target"
    build_tiny_model(config, seed=0).save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    (out.parent / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS) + "\n"
    )
    return out


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), cache_dir=None, dtype="float32")


def test_each_export_is_read_as_its_framework_wrote_it():
    expect = {  # producer, version, HF indices, recorded, where
        "speculators": ("speculators", "0.9.0", [2, 4, 5], True, "eagle_aux_hidden_state_layer_ids (HF indices)"),
        "modelopt": ("modelopt", None, [2, 4, 5], True, "eagle_config.eagle_aux_hidden_state_layer_ids + 1"),
        "specforge": ("specforge", None, [2, 4, 5], False, "not recorded: SpecForge's default"),
    }
    for name, (producer, version, ids, recorded, where) in expect.items():
        dd = read_draft_dir(PEERS / name)
        capture = dd.capture(8)
        assert (dd.producer, dd.version, capture.hf_indices, capture.recorded) == (producer, version, ids, recorded)
        assert capture.source.startswith(where)
        weights = dd.weights()  # under our names whatever the file calls them
        assert "midlayer.self_attn.q_proj.weight" in weights and not any(k.startswith("layers.") for k in weights)
    spec = read_draft_dir(PEERS / "speculators")
    # speculators' defaults: norm before fc (its input_norm, our aux_norm), normed residual, normed output
    assert spec.flags("vllm").changed() == ["aux_norm", "norm_before_residual", "norm_output"]
    assert "aux_norm.weight" in spec.weights() and spec.sliding_window() == 2048
    assert spec.flags("sglang").norm_before_residual is False  # SGLang's first layer never norms the residual
    for name in ("modelopt", "specforge"):
        assert read_draft_dir(PEERS / name).flags("vllm").changed() == []
    # a ModelOpt export's 0-based ids for a deeper target: +1 whatever N is
    assert read_draft_dir(PEERS / "modelopt").capture(32).hf_indices == [2, 4, 5]
    assert read_draft_dir(PEERS / "specforge").capture(32).hf_indices == [2, 16, 29]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(cfg, positions, d):
    """cos, sin [T, d] as the engines build them from the draft's config (YaRN included)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = cfg.get("rope_parameters") or {
        "rope_theta": cfg.get("rope_theta", 10000.0),
        **(cfg.get("rope_scaling") or {}),
    }
    kind = rope.get("rope_type", "default")
    if kind == "default":
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        scale = 1.0
    else:
        lc = LlamaConfig(
            hidden_size=cfg["hidden_size"],
            num_attention_heads=cfg["num_attention_heads"],
            head_dim=d,
            max_position_embeddings=cfg["max_position_embeddings"],
            rope_parameters=dict(rope),
        )
        inv, scale = ROPE_INIT_FUNCTIONS[kind](lc, "cpu")
    f = positions[:, None].double() * inv[None].double()
    emb = torch.cat([f, f], dim=-1)
    return (emb.cos() * scale).float(), (emb.sin() * scale).float()


def _rot(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def reference_chain(path, embed, aux, ids, k, flags):
    """Greedy chain of k drafts after the last context position, with the engines' math (F1-F5 of
    benchmarks/notes/peer_forward.md), from the file's own tensor names: target ids and the logits."""
    c = json.loads((path / "config.json").read_text())
    cfg = c.get("transformer_layer_config") or c
    w = {n: t.float() for n, t in load_file(str(path / "model.safetensors")).items()}
    p = "layers.0." if "layers.0.fc" not in w and any(n.startswith("layers.0.") for n in w) else "midlayer."
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d2t = w.get("d2t", torch.zeros(w["lm_head.weight"].shape[0])).long()
    x = aux
    if flags.get("norm_before_fc"):
        x = _rms(x, w["input_norm.weight"], eps)
    if flags.get("fc_norm"):  # one norm per aux state, each over its own H_t columns
        parts = x.chunk(sum(n.startswith("fc_norm.") for n in w), dim=-1)
        x = torch.cat([_rms(part, w[f"fc_norm.{i}.weight"], eps) for i, part in enumerate(parts)], dim=-1)
    h = x @ w["fc.weight"].T  # [T, H]
    t = aux.shape[0]
    keys, values = [], []

    def layer(emb, hid, pos):  # emb, hid [n, H]; pos [n]; attends to every stored key and its own
        hn = _rms(hid, w[p + "hidden_norm.weight"], eps)
        xin = torch.cat([_rms(emb, w[p + "input_layernorm.weight"], eps), hn], dim=-1)
        q = (xin @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, d)
        kk = (xin @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d)
        vv = (xin @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
        cos, sin = _rope(cfg, pos, d)
        q = q * cos[:, None] + _rot(q) * sin[:, None]
        kk = kk * cos[:, None] + _rot(kk) * sin[:, None]
        return q, kk, vv, (hn if flags.get("norm_before_residual") else hid)

    def attend(q, kk, vv, causal):
        kk, vv = kk.repeat_interleave(nh // nkv, dim=1), vv.repeat_interleave(nh // nkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).reshape(q.shape[0], -1)

    def finish(att, res):
        g = res + att @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(g, w[p + "post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        return g + mlp

    q, kk, vv, res = layer(embed[ids[1 : t + 1]], h, torch.arange(t))
    out = finish(attend(q, kk, vv, causal=True), res)[-1:]
    keys, values = [kk], [vv]
    tokens, logits = [], []
    for j in range(k):
        lg = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        logits.append(lg[0])
        i = int(lg[0].argmax())
        tokens.append(i + int(d2t[i]))
        if j + 1 == k:
            break
        hid = _rms(out, w["norm.weight"], eps) if flags.get("norm_output") else out
        q, kk, vv, res = layer(embed[torch.tensor([tokens[-1]])], hid, torch.tensor([t - 1 + j + 1]))
        keys.append(kk)
        values.append(vv)
        out = finish(attend(q, torch.cat(keys), torch.cat(values), causal=False), res)
    return tokens, torch.stack(logits)


def our_chain(draft, aux, ids, k):
    t = aux.shape[0]
    cache: list = []
    h = draft.step(draft.fuse(aux[None]), ids[None, 1 : t + 1], torch.arange(t)[None], cache, 0)[:, -1]
    tokens, logits = [], []
    for j in range(k):
        lg = draft.logits(h)
        logits.append(lg[0])
        tokens.append(int(draft.to_target(lg.argmax(-1))[0]))
        if j + 1 < k:
            h = draft.step(h[:, None], torch.tensor([[tokens[-1]]]), torch.tensor([[t - 1 + j + 1]]), cache, j + 1)[
                :, 0
            ]
    return tokens, torch.stack(logits)


ENGINE_FLAGS = {  # what the engine computes for each export, as its config says (the notes' section 6)
    ("speculators", "vllm"): {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    ("modelopt", "vllm"): {},
    ("modelopt", "sglang"): {},
    ("specforge", "vllm"): {},
    ("specforge", "sglang"): {},
}


@pytest.mark.parametrize(("name", "engine"), list(ENGINE_FLAGS))
def test_the_draft_eval_builds_computes_what_the_engine_does(target, name, engine):
    draft, dd = load_draft_dir(PEERS / name, target, engine)
    draft.float()
    g = torch.Generator().manual_seed(0)
    t, k = 9, 4
    aux = torch.randn(t, draft.fc.in_features, generator=g)
    ids = torch.randint(0, 256, (t + 1,), generator=g)
    embed = target.model.get_input_embeddings().weight.detach().float()
    with torch.no_grad():
        want_tokens, want = reference_chain(PEERS / name, embed, aux, ids, k, ENGINE_FLAGS[name, engine])
        got_tokens, got = our_chain(draft, aux, ids, k)
        # the chain eval decodes with (propose) drafts the same tokens
        cache: list = []
        h = draft.step(draft.fuse(aux[None]), ids[None, 1:], torch.arange(t)[None], cache, 0)[:, -1]
        proposed = draft.propose(h, torch.tensor([t - 1]), cache, k)[0].tolist()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_tokens == want_tokens == proposed
    if ENGINE_FLAGS[name, engine]:  # the flags matter: the plain head computes otherwise
        with torch.no_grad():
            _, plain = reference_chain(PEERS / name, embed, aux, ids, k, {})
        assert not torch.allclose(plain, want, atol=1e-2)


def test_check_reports_each_format(target_dir, said):
    def check(name, **kw):
        return run_check(CheckConfig(draft=str(PEERS / name), target=str(target_dir), **kw))

    # speculators: vLLM reads it (top-level HF ids, its flags); SGLang has no reader for the format
    assert check("speculators", engines=["vllm"]) == 0
    out = said()
    assert (
        "format: speculators 0.9.0 export" in out
        and "trained on: HF [2, 4, 5], eagle_aux_hidden_state_layer_ids" in out
    )
    assert "forward flags aux_norm, norm_before_residual, norm_output" in out and "sliding window 2048" in out
    assert "it leaves unsaid: the target's revision or config hash" in out
    assert check("speculators", engines=["vllm", "sglang"]) == 1
    assert "SGLang 0.5.17 cannot load a speculators export" in said()
    # no engine named: each judged on its own, and the draft passes where one serves it
    assert check("speculators") == 0
    out = said()
    assert "serve with: vllm (each engine judged on its own" in out
    assert "WARNING: sglang cannot serve it: SGLang 0.5.17 cannot load a speculators export" in out
    assert check("speculators", serving=ServingConfig(engine="vllm")) == 0 and "serve with" not in said()
    assert check("speculators", serving=ServingConfig(engine="sglang")) == 1
    said()
    # ModelOpt: right on SGLang (ids + 1) and vLLM's V2 runner (the same states by default), one
    # layer early on vLLM's V1 runner, which takes eagle_config's ids as they are
    assert check("modelopt", engines=["sglang", "vllm"]) == 1
    out = said()
    assert "format: NVIDIA ModelOpt export" in out and "sglang 0.5.17, 0.5.23: eagle_config" in out
    assert "captures HF [1, 3, 4], the draft was trained on [2, 4, 5]" in out and "(V1 runner)" in out
    assert "hidden_norm(input_layernorm(h))" in out and "YaRN rope scaling" in out
    assert check("modelopt") == 0 and "serve with: sglang" in said()
    assert check("modelopt", engines=["sglang"]) == 0
    said()
    # SpecForge without eagle_config: the capture is unsaid, both engines take their default
    assert check("specforge") == 0
    out = said()
    assert "trained on: HF [2, 4, 5], not recorded: SpecForge's default [2, N//2, N-3]" in out
    assert "it leaves unsaid: the layers it was trained on; which target it was trained for" in out


def test_check_warns_where_vllm_plans_the_drafts_attention_with_the_targets_shape(target_dir, tmp_path, said):
    """ModelOpt's default draft (32 heads of 128) beside SmolLM2 (9 of 64) stopped vLLM 0.26.0 at start on
    an H200 (FA3's schedule planned with the target's shape): check says so for vLLM, not for SGLang,
    and says nothing where the shapes agree. The same weights, read as 8 heads (4 key/value) of 8."""
    assert run_check(CheckConfig(draft=str(PEERS / "speculators"), target=str(target_dir), engines=["vllm"])) == 0
    assert "attention is" not in said()
    for name in ("speculators", "modelopt"):
        reshaped = tmp_path / name
        shutil.copytree(PEERS / name, reshaped)
        c = json.loads((reshaped / "config.json").read_text())
        layer = c.get("transformer_layer_config") or c
        layer.update(num_attention_heads=8, num_key_value_heads=4, head_dim=8)  # q 64 and k/v 32 wide, as before
        (reshaped / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(tmp_path / "speculators"), target=str(target_dir), engines=["vllm"])) == 0
    out = said()
    assert (
        "WARNING: vLLM: the draft's attention is 8 heads (4 key/value) of size 8, the target's 4 heads "
        "(2 key/value) of size 16: releases without its PR #53336" in out
    )
    assert "--attention-config.flash_attn_version=2" in out
    run_check(CheckConfig(draft=str(tmp_path / "modelopt"), target=str(target_dir), engines=["sglang"]))
    assert "attention is" not in said()


def test_check_finds_what_engines_would_skip(target_dir, tmp_path, said):
    bad = tmp_path / "nbf_off"
    shutil.copytree(PEERS / "speculators", bad)
    c = json.loads((bad / "config.json").read_text())
    c["norm_before_fc"] = False  # input_norm stays in the file: vLLM loads it and never applies it
    (bad / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(bad), target=str(target_dir), engines=["vllm"])) == 1
    out = said()
    assert "vLLM 0.26.0 loads input_norm but never applies it: norm_before_fc is not set" in out
    assert "1 problem(s)" in out and "not part of the EAGLE-3 draft" not in out  # said once, by its own name
    sf = tmp_path / "sf_norm_output"
    shutil.copytree(PEERS / "specforge", sf)
    c = json.loads((sf / "config.json").read_text())
    c["norm_output"] = True
    (sf / "config.json").write_text(json.dumps(c))
    assert run_check(CheckConfig(draft=str(sf), target=str(target_dir))) == 0
    assert "SpecForge 0.2.0 trains it as 'norm before lm_head'" in said()
    four = tmp_path / "four_states"
    shutil.copytree(PEERS / "specforge", four)
    w = load_file(str(four / "model.safetensors"))
    w["fc.weight"] = torch.zeros(64, 256, dtype=torch.bfloat16)
    save_file(w, str(four / "model.safetensors"), metadata={"format": "pt"})
    assert run_check(CheckConfig(draft=str(four), target=str(target_dir), engines=["vllm"])) == 1
    assert "sizes fc for 3 states (no eagle_config ids: 3) of width 64 = 192, but fc takes 256" in said()


def evaluate(target_dir, name, engine):
    return Evaluator(
        EvalConfig(
            draft=str(PEERS / name),
            target=str(target_dir),
            engine=engine,
            prompts=str(target_dir.parent / "prompts.jsonl"),
            max_new_tokens=24,
            k=3,
            progress=False,
            out=str(target_dir.parent / f"eval-{name}-{engine}"),
        )
    ).run()


def test_eval_runs_each_peer_export_as_its_engine_would(target_dir):
    spec = evaluate(target_dir, "speculators", "vllm")
    assert spec["lossless_counts"]["identical"] == len(PROMPTS) and spec["trained_hf_indices"] == [2, 4, 5]
    assert any("sliding window of 2048 tokens" in w for w in spec["warnings"])
    with pytest.raises(ContractError, match="SGLang 0.5.17 cannot load a speculators export"):
        evaluate(target_dir, "speculators", "sglang")
    mo = evaluate(target_dir, "modelopt", "sglang")
    assert mo["lossless_counts"]["identical"] == len(PROMPTS) and mo["captured_hf_indices"] == [2, 4, 5]
    assert any("hidden_norm(input_layernorm(h))" in w for w in mo["warnings"])
    sf = evaluate(target_dir, "specforge", "vllm")
    assert sf["trained_hf_indices"] is None and any("not recorded: SpecForge's default" in w for w in sf["warnings"])


@pytest.mark.slow
def test_the_vllm_standin_serves_a_speculators_export_as_eval_computes_it(target_dir):
    """The stand-in vLLM (what the lab's CPU runs serve peers' drafts with) runs a speculators export
    with vLLM's forward (its input_norm, normed residual and normed output; SGLang cannot load the
    format at all): its served figures are eagle3-eval's with engine=vllm."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from standin_engines import StandinVllm
    from test_served_acceptance import measure

    ev = evaluate(target_dir, "speculators", "vllm")
    spec = {"method": "eagle3", "model": str(PEERS / "speculators"), "num_speculative_tokens": 3}
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with StandinVllm(model, tokenizer=AutoTokenizer.from_pretrained(target_dir), speculative=spec) as server:
        served = measure(
            server.url, target_dir.parent / "prompts.jsonl", target_dir.parent / "served", max_new_tokens=24
        )
    assert served.mean_acceptance_length == pytest.approx(ev["tau"], abs=1e-9)
    assert served.conditional_acceptance_per_position == pytest.approx(ev["acceptance_per_position"], abs=1e-9)
    assert served.drafts == ev["verify_steps"] and served.completion_tokens == ev["tokens"]


def test_the_eval_report_says_who_wrote_the_draft(target_dir):
    report = evaluate(target_dir, "speculators", "vllm")
    assert report["draft_format"] == {
        "producer": "speculators",
        "version": "0.9.0",
        "trained_hf_indices": [2, 4, 5],
        "trained_from": "eagle_aux_hidden_state_layer_ids (HF indices)",
        "recorded": True,
        "flags": ["aux_norm", "norm_before_residual", "norm_output"],
        "as_trained": False,
    }


def test_as_trained_computes_modelopts_own_training_forward(target):
    """ModelOpt trains its first layer on hidden_norm(input_layernorm(h)) with plain RoPE; its export
    is served with hidden_norm(h) and the YaRN scaling the export wrote. as_trained gives the first."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    served, _ = load_draft_dir(PEERS / "modelopt", target, "sglang")
    trained, dd = load_draft_dir(PEERS / "modelopt", target, "sglang", as_trained=True)
    assert dd.trained_flags().changed() == ["hidden_input_norm"]
    assert (
        trained.config.rope_parameters["rope_type"] == "default"
        and served.config.rope_parameters["rope_type"] == "yarn"
    )
    g = torch.Generator().manual_seed(0)
    t = 7
    aux = torch.randn(1, t, 192, generator=g)
    ids = torch.randint(0, 256, (1, t + 1), generator=g)
    with torch.no_grad():
        out = trained.float().step(trained.fuse(aux), ids[:, 1:], torch.arange(t)[None], [], 0)
        # the reference: transformers' own LlamaDecoderLayer (ModelOpt's draft layer) with its attention
        # input replaced as ModelOpt's hook does, plain RoPE at the config's theta
        c = json.loads((PEERS / "modelopt" / "config.json").read_text())
        lc = LlamaConfig(**{k: v for k, v in c.items() if k not in ("rope_scaling", "eagle_config")})
        lc.rope_parameters = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        rope = LlamaRotaryEmbedding(lc)
        m = trained.midlayer
        h = trained.fuse(aux)
        emb = target.model.get_input_embeddings()(ids[:, 1:]).float()
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(m.input_layernorm(h))], dim=-1)
        cos, sin = rope(h, torch.arange(t)[None])
        q, k, v = m.self_attn.project(x, cos, sin)
        a = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
        g1 = h + m.self_attn.o_proj(a.transpose(1, 2).flatten(2))
        want = g1 + m.mlp(m.post_attention_layernorm(g1))
        served_out = served.float().step(served.fuse(aux), ids[:, 1:], torch.arange(t)[None], [], 0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(served_out, want, atol=1e-3)


def test_bad_and_unusual_directories(target, tmp_path):
    from eagle3_train.core.errors import BadInputError

    def copy(name, dest):
        shutil.copytree(PEERS / name, tmp_path / dest)
        return tmp_path / dest

    bad = copy("specforge", "list_config")
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="config.json: not a JSON object"):
        read_draft_dir(bad)
    ids = copy("modelopt", "string_ids")
    c = json.loads((ids / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = "1,3,4"
    (ids / "config.json").write_text(json.dumps(c))
    with pytest.raises(BadInputError, match="eagle_config.eagle_aux_hidden_state_layer_ids is not a list of integers"):
        read_draft_dir(ids)
    shaped = copy("specforge", "wrong_vocab")
    c = json.loads((shaped / "config.json").read_text())
    c["draft_vocab_size"] = 64  # lm_head and d2t hold 32
    (shaped / "config.json").write_text(json.dumps(c))
    with pytest.raises(
        BadInputError,
        match=r"weights of another shape than its config.json says: \['d2t \(32,\) \(the config makes it \(64,\)\)', 'lm_head.weight",
    ):
        load_draft_dir(shaped, target, "sglang")
    # the weights in two shards, as save_pretrained splits large drafts: the same draft
    sharded = copy("specforge", "sharded")
    w = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    keys = sorted(w)
    save_file({k: w[k] for k in keys[:5]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({k: w[k] for k in keys[5:]}, str(sharded / "model-00002-of-00002.safetensors"))
    one, _ = load_draft_dir(PEERS / "specforge", target, "sglang")
    two, _ = load_draft_dir(sharded, target, "sglang")
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))
    # input_norm without norm_before_fc: both engines load it and never apply it; eval does the same
    extra = copy("specforge", "input_norm_unflagged")
    w = load_file(str(extra / "model.safetensors"))
    w["input_norm.weight"] = torch.full((192,), 3.0, dtype=torch.bfloat16)
    save_file(w, str(extra / "model.safetensors"))
    plain, _ = load_draft_dir(extra, target, "vllm")
    assert not plain.config.aux_norm and not hasattr(plain, "aux_norm")
    # SpecForge 0.2.0 with norm_output=false trained un-normed logits: not computed, said so
    t2 = copy("specforge", "t2")
    c = json.loads((t2 / "config.json").read_text())
    c["norm_output"] = False
    (t2 / "config.json").write_text(json.dumps(c))
    with pytest.raises(ContractError, match="as_trained=true: SpecForge 0.2.0 trained logits without the final norm"):
        load_draft_dir(t2, target, "sglang", as_trained=True)
    load_draft_dir(t2, target, "sglang")  # as served: the engines' meaning
