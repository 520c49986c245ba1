"""One module + one registry line is an engine: a stand-in engine, registered here and nowhere
else, is taken by every consumer -- served regeneration, the served dump, export, check, eval,
served acceptance and eagle3-bench -- with the same results as the engines it borrows its APIs from.

The stand-in reads its ids from a key of its own, ``standin_layer_ids``, by the rule "id v captures
HF index v+1", so what export writes for it, and what check and eval read back, is its rule's and
no other engine's. It speaks vLLM's hidden-state, generation and metrics APIs (the vLLM stand-in
server of tests/standin_engines.py answers it).
"""

import dataclasses
import json
import random
import shutil

import pytest

from data_prep.dump import CaptureConfig, ClientConfig, DumpConfig, Dumper, ServerConfig
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.served_regen import ServedRegenConfig
from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.core.errors import ConfigError
from eagle3_train.engines import registry, vllm
from eagle3_train.engines.base import Command, Engine, Rule, plus_one
from eagle3_train.evaluation.bench import Bench, BenchConfig
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.evaluation.served_acceptance import ServedAcceptance, ServedAcceptanceConfig
from eagle3_train.serving.check import CheckConfig, run_check
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from standin_engines import StandinVllm
from test_served_dump import assert_same_samples
from test_trainer import train

KEY = "standin_layer_ids"
AUX, N = [1, 2, 3], 4  # the capture, and the tiny target's depth
COMMAND = Command(
    ("standin-serve",), ("model",), {"--draft": "value", "--draft-tokens": "int", "--port": "int"}, "the stand-in's own"
)


def serve(target, draft, k, flags):
    return (
        COMMAND.line(target, **flags) if draft is None else COMMAND.line(target, **flags, draft=draft, draft_tokens=k)
    )


STANDIN = Engine(
    name="standin",
    title="Stand-in",
    version="0.1",
    exports=True,
    foreign_weights="would drop",
    rules=(Rule("0.1", "*", ((KEY,),), plus_one, "reads its own key"),),
    command=COMMAND,
    serve=serve,
    version_route=("/version", "version"),
    capture=vllm.ENGINE.capture,
    generation=vllm.ENGINE.generation,
    metrics=dataclasses.replace(vllm.ENGINE.metrics, engine="standin", read_from="the stand-in's counters"),
)


def test_an_engine_not_in_the_registry_is_refused_by_every_consumer():
    with pytest.MonkeyPatch.context() as mp:
        mp.delitem(registry.ENGINES, "standin", raising=False)
        for make in (
            lambda: ExportConfig(run="r", out="o", engines=["standin"]),
            lambda: CheckConfig(draft="d", target="t", engines=["standin"]),
            lambda: EvalConfig(draft="d", prompts="p", engine="standin"),
            lambda: DumpConfig(backend="standin", out="o", data="d"),
            lambda: RegenConfig(backend="standin"),
            lambda: ServedAcceptanceConfig(server="http://x:1", prompts="p", out="o", engine="standin"),
            lambda: BenchConfig(out="o", engine="standin", target="t", draft="d"),
        ):
            with pytest.raises(ConfigError, match="standin"):
                make()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The stand-in registered, and the pipeline run through it: prepare (the target's replies
    through the stand-in, and through transformers), dump (through it, and in transformers),
    standardize, a short training, export for SGLang, vLLM and the stand-in."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.ENGINES, "standin", STANDIN)
        root = tmp_path_factory.mktemp("standin")
        rng = random.Random(0)
        words = ["apple", "river", "stone", "cloud", "seven", "tiger", "music", "paper"]
        rows = [
            {"messages": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))}]}
            for _ in range(12)
        ]
        (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

        def prepare(out, regen):
            Preparer(
                PrepareConfig(
                    target="tiny",
                    input=str(root / "prompts.jsonl"),
                    out=str(root / out),
                    regenerate=True,
                    regen=regen,
                    progress=False,
                )
            ).run()

        with StandinVllm(build_tiny_model()) as server:
            prepare(
                "prep",
                RegenConfig(
                    max_new_tokens=12,
                    backend="standin",
                    server=ServedRegenConfig(url=server.url, wait_for_server_s=5.0),
                ),
            )
            (root / "regen_requests").write_text(str(len(server.bodies)))
        prepare("prep_hf", RegenConfig(max_new_tokens=12))

        def dump(out, **kw):
            return Dumper(
                DumpConfig(
                    target="tiny",
                    data=str(root / "prep"),
                    out=str(root / out),
                    dtype="float32",
                    capture=CaptureConfig(aux_indices=AUX),
                    progress=False,
                    **kw,
                )
            ).run()

        dump("dump_hf")
        with StandinVllm(build_tiny_model(), [*AUX, N], root / "engine") as server:
            dump(
                "dump",
                backend="standin",
                server=ServerConfig(url=server.url),
                client=ClientConfig(concurrency=4, wait_for_server_s=5.0),
            )
        Standardizer(
            StandardizeConfig(
                dumps=[str(root / "dump")],
                out=str(root / "std"),
                draft_vocab_size=320,
                eval_fraction=0.2,
                progress=False,
            )
        ).run()
        train(root / "std", root / "train", max_steps=4)
        Exporter(
            ExportConfig(run=str(root / "train"), out=str(root / "export"), engines=["sglang", "vllm", "standin"])
        ).run()
        yield root


@pytest.mark.slow
def test_regeneration_through_it_equals_transformers(root):
    from datasets import load_from_disk

    got, want = (load_from_disk(str(root / p / "dataset")) for p in ("prep", "prep_hf"))
    assert int((root / "regen_requests").read_text()) == 12  # every reply came from the engine
    assert got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]


def test_the_dump_through_it_equals_the_transformers_dump(root):
    manifest = json.loads((root / "dump" / "manifest.json").read_text())
    assert manifest["run"]["backend"] == "standin" and manifest["run"]["next_token_check"]["checked"] == 12
    assert_same_samples(root / "dump", root / "dump_hf")


def test_export_writes_its_keys_and_its_serve_command(root):
    config = json.loads((root / "export" / "config.json").read_text())
    assert config[KEY] == [0, 1, 2]  # its rule: id v captures HF v+1
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["eagle3_train"]["engines"][-1] == "standin"
    card = (root / "export" / "README.md").read_text()
    assert "standin-serve tiny --draft export --draft-tokens 3" in card  # the 3 TTT steps it was trained for
    assert f"| Stand-in 0.1 | `{KEY}` | `[0, 1, 2]` | HF [1, 2, 3] |" in card


def test_check_and_eval_resolve_by_its_rule(root, said):
    """Check and eval read the stand-in's key by its rule (it is registered while the module's fixture lives)."""
    engines = ["sglang", "vllm", "standin"]
    said()
    assert run_check(CheckConfig(draft=str(root / "export"), target="tiny", engines=engines)) == 0
    assert f"standin 0.1: {KEY}=[0, 1, 2] -> captures HF [1, 2, 3]  OK" in said()
    shifted = root / "shifted"  # only the stand-in's key moved: only the stand-in's capture moves
    shutil.copytree(root / "export", shifted)
    config = json.loads((shifted / "config.json").read_text())
    (shifted / "config.json").write_text(json.dumps(config | {KEY: [1, 2, 3]}))
    assert run_check(CheckConfig(draft=str(shifted), target="tiny", engines=engines)) == 1
    out = said()
    assert (
        f"standin 0.1: {KEY}=[1, 2, 3] -> captures HF [2, 3] + the pre-norm final state (no HF index)  MISMATCH" in out
    )
    assert (
        "sglang 0.5.17, 0.5.23: eagle_config.eagle_aux_hidden_state_layer_ids=[0, 1, 2] -> captures HF [1, 2, 3]  OK"
        in out
    )

    def evaluate(draft, engine):
        return Evaluator(
            EvalConfig(
                draft=str(draft),
                target="tiny",
                engine=engine,
                prompts=str(root / "prompts.jsonl"),
                limit=3,
                max_new_tokens=8,
                progress=False,
                out=str(root / f"eval_{draft.name}_{engine}"),
            )
        )

    assert evaluate(shifted, "standin").layers == [2, 3, N] and evaluate(shifted, "sglang").layers == AUX
    ours, sglang = evaluate(root / "export", "standin"), evaluate(root / "export", "sglang")
    assert ours.resolution.source == KEY and ours.layers == sglang.layers == AUX
    a, b = ours.run(), sglang.run()
    assert a["engine"] == "standin" and (a["tau"], a["acceptance_per_position"]) == (
        b["tau"],
        b["acceptance_per_position"],
    )


def test_served_acceptance_reads_its_metrics(root):
    spec = {"method": "eagle3", "model": "unused-with-a-plan", "num_speculative_tokens": 5}
    with StandinVllm(
        build_tiny_model(), tokenizer=build_tiny_tokenizer(), speculative=spec, accepted_plan=lambda messages: [5, 2, 0]
    ) as server:
        report = ServedAcceptance(
            ServedAcceptanceConfig(
                server=server.url,
                prompts=str(root / "prompts.jsonl"),
                out=str(root / "served"),
                engine="standin",
                limit=2,
                max_new_tokens=6,
                settle_s=0.01,
            )
        ).run()
    assert report.engine == "standin" and report.metrics_read_from == "the stand-in's counters"
    assert (report.drafts, report.accepted_tokens) == (6, 14)  # two requests of drafts accepting 5, 2, 0


def test_the_bench_starts_it_by_its_own_command(root, tmp_path):
    bench = Bench(
        BenchConfig(
            out=str(tmp_path),
            engine="standin",
            target="org/target",
            draft="org/draft",
            port=8123,
            num_speculative_tokens=4,
            engine_args="--x 1",
            plot=False,
        )
    )
    assert bench.argv("baseline") == ["standin-serve", "org/target", "--port", "8123", "--x", "1"]
    assert bench.argv("spec") == [
        "standin-serve",
        "org/target",
        "--port",
        "8123",
        "--draft",
        "org/draft",
        "--draft-tokens",
        "4",
        "--x",
        "1",
    ]


def test_the_bench_gives_both_engines_the_drafts_dtype_where_the_engine_keeps_the_drafts_own(root, tmp_path):
    """An engine that runs the draft in its own config's dtype (SGLang 0.5.17 stopped at its first
    request on a float16 target with a bfloat16 draft) gets --dtype <draft's> on both sides, with a
    warning; not where the dtypes agree, the engine follows the target, or the user named one."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    for path, dtype in ((target, "float16"), (draft, "bfloat16")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"torch_dtype": dtype}))

    def bench(engine_args="", **engine):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(registry.ENGINES, "standin", dataclasses.replace(STANDIN, **engine))
            b = Bench(
                BenchConfig(
                    out=str(tmp_path / "out"),
                    engine="standin",
                    target=str(target),
                    draft=str(draft),
                    port=8123,
                    engine_args=engine_args,
                    plot=False,
                )
            )
            return b, b.argv("baseline"), b.argv("spec")

    own = {"draft_dtype_own": "it stops"}
    b, base, spec = bench(**own)
    assert base[-2:] == ["--dtype", "bfloat16"] and spec[-2:] == ["--dtype", "bfloat16"]
    assert len(b.warnings) == 1 and "float16" in b.warnings[0] and "it stops" in b.warnings[0]
    b, base, spec = bench("--dtype=float16", **own)  # the user's choice stands
    assert base.count("--dtype=float16") == 1 and "bfloat16" not in base + spec and not b.warnings
    b, base, spec = bench()  # an engine that runs the draft in the target's dtype
    assert "--dtype" not in base + spec and not b.warnings
    (draft / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    b, base, spec = bench(**own)
    assert "--dtype" not in base + spec and not b.warnings
