"""eagle3-dump backend=vllm|sglang against stand-in servers fed by the tiny target.

The shards written through each engine client must equal a ``backend=hf`` dump of the same data;
every refusal, retry and check of data_prep/dump/served.py and eagle3_train/engines/{vllm,sglang}.py is driven
through the servers' API surface.
"""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from data_prep.dump import CaptureConfig, ClientConfig, DumpConfig, Dumper, ServerConfig, launch_text, verify
from data_prep.dump.backend import make_backend
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.engines.http import EngineError
from eagle3_train.engines.rules import Unexpressible
from eagle3_train.engines.sglang import exact_rows
from eagle3_train.engines.vllm import final_norm
from eagle3_train.targets.tiny import build_tiny_model
from standin_engines import EngineRefused, StandinSglang, StandinVllm
from test_dump import mixed_conversations, prepare_tiny, stored_samples

AUX = [1, 2, 3]
N = 4  # the tiny target's layers


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """24 conversations of mixed lengths, prepared for the tiny target."""
    return prepare_tiny(tmp_path_factory.mktemp("served"), mixed_conversations(24, seed=1, max_user=40, max_words=15))


def config(prepared, out, backend="hf", aux=AUX, extra=(), **kw):
    client = ClientConfig(**{"concurrency": 4, "backoff_s": 0.01, "wait_for_server_s": 5.0, **kw.pop("client", {})})
    return DumpConfig(
        target="tiny",
        data=str(prepared),
        out=str(out),
        backend=backend,
        dtype=kw.pop("dtype", "float32"),
        capture=CaptureConfig(aux_indices=list(aux), extra_indices=list(extra)),
        progress=False,
        max_tokens_per_batch=600,
        shard_size_mb=kw.pop("shard_size_mb", 0.05),
        server=kw.pop("server", ServerConfig()),
        client=client,
        **kw,
    )


@pytest.fixture(scope="module")
def hf_dump(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "dump"
    Dumper(config(prepared, out)).run()
    return out


def vllm(out, **kw):
    return StandinVllm(build_tiny_model(), [*AUX, N], out.parent / "engine", **kw)


def sglang_pair(dtype=torch.float32):
    return StandinSglang(build_tiny_model(), [k - 1 for k in AUX], dtype), StandinSglang(
        build_tiny_model(), None, dtype
    )


def assert_same_samples(a, b, atol=1e-5):
    sa, sb = stored_samples(a), stored_samples(b)
    assert sorted(sa) == sorted(sb)
    for sid in sa:
        assert sa[sid].keys() == sb[sid].keys()
        for key in sa[sid]:
            assert sa[sid][key].dtype == sb[sid][key].dtype, key
            torch.testing.assert_close(sa[sid][key], sb[sid][key], atol=atol, rtol=0, msg=f"sample {sid} {key}")


def test_vllm_backend_equals_hf_dump(prepared, hf_dump, tmp_path):
    out = tmp_path / "dump"
    with vllm(out) as server:
        manifest = Dumper(config(prepared, out, "vllm", server=ServerConfig(url=server.url))).run()
    hf = json.loads((hf_dump / "manifest.json").read_text())
    assert manifest["capture"] == hf["capture"] and manifest["keys"] == hf["keys"]
    assert manifest["counts"]["samples"] == 24 and manifest["run"]["next_token_check"] == {"checked": 24, "agreed": 24}
    assert_same_samples(out, hf_dump)
    assert verify(out) == []
    assert not any((out / "engine_files").rglob("*.safetensors*"))  # the engine's files were cleaned up


def test_sglang_backend_equals_hf_dump(prepared, hf_dump, tmp_path):
    out = tmp_path / "dump"
    aux, final = sglang_pair()
    with aux, final:
        Dumper(config(prepared, out, "sglang", extra=(), server=ServerConfig(url=aux.url, final_url=final.url))).run()
    hf = stored_samples(hf_dump)
    got = stored_samples(out)
    assert sorted(got) == sorted(hf)
    for sid in got:
        assert set(got[sid]) == {"input_ids", "loss_mask", "hidden.1", "hidden.2", "hidden.3", "last_hidden"}
        for key in got[sid]:
            torch.testing.assert_close(got[sid][key], hf[sid][key], atol=1e-5, rtol=0)


def test_bfloat16_states_arrive_exactly(prepared, tmp_path):
    """JSON rows and vLLM files of a bf16 engine become the very bf16 values the engine held."""
    model = build_tiny_model().to(torch.bfloat16)
    prompt = [5, 9, 200, 31, 7]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    for layer in (1, 2, 3):
        values = out.hidden_states[layer][0]
        assert torch.equal(exact_rows(values.float().tolist(), 64, torch.bfloat16, "x"), values)
    with pytest.raises(EngineError, match="are not bfloat16 numbers: the engine runs in another dtype"):
        exact_rows((out.hidden_states[1][0].float() + 1e-4).tolist(), 64, torch.bfloat16, "x")
    # the same dump through both engines, in bf16: equal to each other where both hold the layer
    a, b = tmp_path / "v", tmp_path / "s"
    with vllm(a, dtype=torch.bfloat16) as server:
        Dumper(config(prepared, a, "vllm", dtype="bfloat16", server=ServerConfig(url=server.url))).run()
    aux, final = sglang_pair(torch.bfloat16)
    with aux, final:
        Dumper(
            config(
                prepared, b, "sglang", dtype="bfloat16", extra=(), server=ServerConfig(url=aux.url, final_url=final.url)
            )
        ).run()
    sa, sb = stored_samples(a), stored_samples(b)
    for sid in sa:
        for key in ("hidden.1", "hidden.2", "hidden.3", "last_hidden"):
            assert sa[sid][key].dtype == torch.bfloat16
            # last_hidden: vLLM's is normed here from the pre-norm state, SGLang's by the model
            assert torch.equal(sa[sid][key], sb[sid][key]), (sid, key)


def test_final_norm_matches_transformers_in_every_dtype():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = LlamaRMSNorm(64, eps=1e-5)
        norm.weight.data = torch.randn(64)
        norm = norm.to(dtype)
        x = (torch.randn(7, 64) * 3).to(dtype)
        assert torch.equal(final_norm(x, norm.weight.data, 1e-5, "llama"), norm(x))


def test_two_clients_share_the_work_and_the_last_writes_the_manifest(prepared, hf_dump, tmp_path):
    out = tmp_path / "dump"
    with vllm(out) as server:
        first = Dumper(
            config(prepared, out, "vllm", server=ServerConfig(url=server.url), client={"rank": 1, "world_size": 2})
        )
        assert first.run() is None and not (out / "manifest.json").exists()
        assert len(stored_samples(out)) == 12
        second = Dumper(
            config(prepared, out, "vllm", server=ServerConfig(url=server.url), client={"rank": 0, "world_size": 2})
        )
        manifest = second.run()
    assert manifest["counts"]["samples"] == 24
    assert manifest["run"]["next_token_check"] == {"checked": 24, "agreed": 24}  # both clients' counts
    assert_same_samples(out, hf_dump)


def test_transient_failures_are_retried(prepared, hf_dump, tmp_path):
    """503s, a request slower than its timeout, and a file the engine never wrote: retried."""
    out = tmp_path / "dump"
    with vllm(out) as server:
        server.fail_posts = {1, 2, 3}
        server.slow_posts = {5: 3.0}
        server.unwritten_posts = {2, 7}
        Dumper(
            config(
                prepared,
                out,
                "vllm",
                server=ServerConfig(url=server.url),
                client={"request_timeout_s": 1.0, "file_timeout_s": 2.0},
            )
        ).run()
    assert_same_samples(out, hf_dump)


def test_repeated_failures_stop_keeping_what_arrived_then_resume(prepared, hf_dump, tmp_path):
    out = tmp_path / "dump"
    cfg = config(prepared, out, "sglang", extra=(), client={"retries": 2, "concurrency": 1})
    aux, final = sglang_pair()
    with aux, final:
        cfg.server = ServerConfig(url=aux.url, final_url=final.url)
        aux.fail_from = 6  # five samples succeed, then the aux server is down for good
        with pytest.raises(
            Eagle3Error,
            match=r"3 attempts failed; the last: .*HTTP 503.*\n  5 samples received before the stop are stored",
        ):
            Dumper(cfg).run()
        assert len(stored_samples(out)) == 5 and not (out / "manifest.json").exists()
        assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".")]  # nothing half-written
        aux.fail_from = None
        Dumper(cfg).run()
    got, hf = stored_samples(out), stored_samples(hf_dump)
    assert sorted(got) == sorted(hf)


@pytest.mark.slow
def test_engine_answers_that_retrying_cannot_fix_stop_at_once(prepared, tmp_path):
    with vllm(tmp_path / "a") as server:
        server.shift_tokens = True
        with pytest.raises(Eagle3Error, match="token_ids differ from the prompt \\(position 0"):
            Dumper(config(prepared, tmp_path / "a", "vllm", server=ServerConfig(url=server.url))).run()
    # the engine launched for another capture (layer 1 left out)
    with (
        StandinVllm(build_tiny_model(), [2, 3, N], tmp_path / "e") as server,
        pytest.raises(
            Eagle3Error, match=r"shape \[\d+, 3, 64\], expected \[\d+, 4, 64\].*launched for another capture"
        ),
    ):
        Dumper(config(prepared, tmp_path / "b", "vllm", server=ServerConfig(url=server.url))).run()
    with (
        vllm(tmp_path / "c", dtype=torch.bfloat16) as server,
        pytest.raises(Eagle3Error, match="states are torch.bfloat16, this dump stores torch.float32"),
    ):
        Dumper(config(prepared, tmp_path / "c", "vllm", server=ServerConfig(url=server.url))).run()
    # the engine ignores the path the client asks for (allow_custom_save_path off) and writes elsewhere
    with (
        vllm(tmp_path / "d", allow_custom_save_path=False) as server,
        pytest.raises(Eagle3Error, match="outside .*allow_custom_save_path"),
    ):
        Dumper(config(prepared, tmp_path / "d", "vllm", server=ServerConfig(url=server.url))).run()
    aux, final = sglang_pair()
    with aux, final:
        servers = ServerConfig(url=aux.url, final_url=final.url)
        aux.cached_tokens = 3
        with pytest.raises(Eagle3Error, match="cached_tokens=3.*--disable-radix-cache"):
            Dumper(config(prepared, tmp_path / "f", "sglang", extra=(), server=servers)).run()
        aux.cached_tokens, final.chunk = 0, 8
        with pytest.raises(Eagle3Error, match="8 rows for \\d+ prompt tokens.*--chunked-prefill-size -1"):
            Dumper(config(prepared, tmp_path / "g", "sglang", extra=(), server=servers)).run()


def test_an_engine_serving_another_model_is_caught(prepared, tmp_path):
    """Same tokenizer, other weights: the engine's next tokens disagree with lm_head(last_hidden)."""
    other = StandinVllm(build_tiny_model(seed=7), [*AUX, N], tmp_path / "engine")
    with other, pytest.raises(Eagle3Error, match="next token is outside the top 5 of lm_head\\(last_hidden\\)"):
        Dumper(config(prepared, tmp_path / "dump", "vllm", server=ServerConfig(url=other.url))).run()


def test_refusals_and_launch_commands(prepared, tmp_path):
    with pytest.raises(Unexpressible, match="HF index 0 \\(the embeddings\\) cannot be captured"):
        Dumper(config(prepared, tmp_path / "a", "sglang", aux=[1, 2], extra=(0,))).run()
    with pytest.raises(ConfigError, match="add backend=sglang or backend=vllm"):
        config(prepared, tmp_path, "hf", print_launch=True)
    # serve=true: this host's engine servers, nothing else
    with pytest.raises(ConfigError, match="serve=true starts an engine: add backend=sglang or backend=vllm"):
        config(prepared, tmp_path, "hf", serve=True)
    with pytest.raises(ConfigError, match="print_launch=true and serve=true each do one thing: choose one"):
        config(prepared, tmp_path, "vllm", print_launch=True, serve=True)
    with pytest.raises(ConfigError, match="out=<dump directory> is required"):
        DumpConfig(target="tiny", backend="vllm", serve=True)
    with pytest.raises(ConfigError, match="serve_devices are the GPUs of the engine servers serve=true starts"):
        config(prepared, tmp_path, "vllm", serve_devices=["0"])
    assert DumpConfig(target="tiny", backend="vllm", serve=True, out=str(tmp_path)).data is None  # no data needed
    with pytest.raises(ConfigError, match="tp_size=2 applies to backend=hf"):
        config(prepared, tmp_path, "vllm", tp_size=2)
    with pytest.raises(ConfigError, match="client.rank=2 must be in"):
        Dumper(config(prepared, tmp_path / "b", "vllm", client={"rank": 2, "world_size": 2}))
    # no server: a clear stop after client.wait_for_server_s
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(Eagle3Error, match="did not become ready within 1 s .*is the engine running"):
        Dumper(
            config(prepared, tmp_path / "c", "vllm", server=ServerConfig(url=closed), client={"wait_for_server_s": 1.0})
        ).run()
    # a partial dump from one backend is not finished by another
    out = tmp_path / "mixed"
    (out).mkdir()
    (out / "request.json").write_text(json.dumps(Dumper(config(prepared, out)).request))
    with pytest.raises(Eagle3Error, match="backend"):
        Dumper(config(prepared, out, "vllm")).run()

    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(target)
    cfg = DumpConfig(
        target=str(target),
        backend="vllm",
        print_launch=True,
        dtype="bfloat16",
        capture=CaptureConfig(aux_indices=[1, 2, 3]),
        server=ServerConfig(server_files_dir="/shared/hs"),
    )
    text = launch_text(cfg)
    assert f"vllm serve {target} --port 8000 --dtype bfloat16 --no-enable-prefix-caching" in text
    # serve=true starts the printed engine command(s), each with its GPUs and its log
    serving = replace(cfg, print_launch=False, serve=True, out=str(tmp_path / "d"), serve_devices=["0,1"])
    (command,) = make_backend(serving).engine_commands(tmp_path / "logs")
    assert command.command in text.replace("\\\n", "") and command.devices == "0,1"
    assert command.log == tmp_path / "logs" / "engine0.log"
    with pytest.raises(ConfigError, match=r"serve_devices lists 3 device sets for the 2 server\(s\) backend=sglang"):
        make_backend(replace(serving, backend="sglang", serve_devices=["0", "1", "2"])).engine_commands(tmp_path)
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,3,4]' in text
    assert '"shared_storage_path":"/shared/hs","allow_custom_save_path":true' in text
    cfg.backend = "sglang"
    text = launch_text(cfg)
    assert "--return-aux-hidden-state-layer-ids 0 1 2" in text and "--port 8000" in text
    assert "--port 30001" in text and "--enable-return-hidden-states" in text
    assert text.count("--disable-radix-cache --chunked-prefill-size -1") == 2


@pytest.mark.slow
def test_print_launch_from_the_command_line(tmp_path):
    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(target)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.dump",
            "backend=vllm",
            f"target={target}",
            "print_launch=true",
            "capture.aux_indices=[1,2]",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,4]' in run.stdout and "<out>/engine_files" in run.stdout
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.dump",
            "backend=sglang",
            f"target={target}",
            "print_launch=true",
            "capture.aux_indices=[0,2]",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "HF index 0 (the embeddings) cannot be captured" in run.stderr


@pytest.mark.slow
def test_client_processes_from_the_command_line_equal_hf(prepared, hf_dump, tmp_path):
    """Two concurrent ``eagle3-dump backend=vllm`` processes (client.rank 0 and 1) share one engine."""
    out = tmp_path / "dump"
    with vllm(out) as server:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "data_prep.dump",
                    "backend=vllm",
                    "target=tiny",
                    f"data={prepared}",
                    f"out={out}",
                    "dtype=float32",
                    "capture.aux_indices=[1,2,3]",
                    f"server.url={server.url}",
                    f"client.rank={r}",
                    "client.world_size=2",
                    "progress=false",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in (0, 1)
        ]
        logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "[client 0/2]" in logs[0] and "[client 1/2]" in logs[1]
    assert json.loads((out / "manifest.json").read_text())["run"]["client_world_size"] == 2
    assert_same_samples(out, hf_dump)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_launch_script_starts_the_printed_engines_and_clients(backend, prepared, hf_dump, tmp_path):
    """launch/dump_served.sh starts the engine command(s) that print_launch prints through
    ``eagle3-dump serve=true`` (here answered by stand-ins that require the same flags) and two
    clients; the dump equals backend=hf, and the engines are stopped at the end."""
    import os
    import socket
    from pathlib import Path

    from eagle3_train.targets.tiny import build_tiny_tokenizer

    repo = Path(__file__).resolve().parents[1]
    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    build_tiny_tokenizer().save_pretrained(target)
    bin_dir, pkg = tmp_path / "bin", tmp_path / "py" / "sglang"
    bin_dir.mkdir()
    pkg.mkdir(parents=True)
    standin = repo / "tests" / "standin_engines.py"
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{standin}" vllm "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        f"import sys\nsys.path.insert(0, {str(standin.parent)!r})\n"
        "import standin_engines\nstandin_engines.main(['sglang', *sys.argv[1:]])\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    urls = [f"server.url=http://127.0.0.1:{ports[0]}", f"server.final_url=http://127.0.0.1:{ports[1]}"]
    out = tmp_path / "dump"
    env = dict(
        os.environ,
        BACKEND=backend,
        CLIENTS="2",
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHONPATH=f"{tmp_path / 'py'}:{repo}",
        EAGLE3_DUMP=f"{sys.executable} -m data_prep.dump",
        ENGINE_DEVICES="0;1" if backend == "sglang" else "0",
    )  # one device list per engine (the stand-ins ignore it)
    run = subprocess.run(
        [
            "bash",
            str(repo / "launch" / "dump_served.sh"),
            f"target={target}",
            f"data={prepared}",
            f"out={out}",
            "dtype=float32",
            "capture.aux_indices=[1,2,3]",
            "progress=false",
            *urls,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    logs = sorted((out / "engine" / socket.gethostname()).glob("engine*.log"))
    assert run.returncode == 0, run.stdout + run.stderr + "".join(f.read_text() for f in logs)
    assert len(logs) == (2 if backend == "sglang" else 1)
    assert "eagle3-dump serve: stopped by a signal; the engine servers are stopped" in run.stdout + run.stderr
    for port in ports[: len(logs)]:
        with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens on its port
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    got, hf = stored_samples(out), stored_samples(hf_dump)
    assert sorted(got) == sorted(hf)
    for sid in got:
        for key in got[sid]:
            torch.testing.assert_close(got[sid][key], hf[sid][key], atol=1e-5, rtol=0)


def typed_target(root, model_type):
    """The tiny target saved as a directory whose config says ``model_type`` (same tokenizer)."""
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    path = root / f"target_{model_type}"
    build_tiny_model().save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
    return path


def launch(target, backend, aux, **server):
    return launch_text(
        DumpConfig(
            target=str(target),
            backend=backend,
            print_launch=True,
            dtype="bfloat16",
            capture=CaptureConfig(aux_indices=aux),
            server=ServerConfig(**server),
        )
    )


def pretend(model_type):
    model = build_tiny_model()
    model.config.model_type = model_type
    return model


def test_vllm_backend_refuses_targets_without_its_eagle3_interface(tmp_path):
    """vLLM fails to load extract_hidden_states for a target class without its EAGLE-3 interface
    (the stand-in does too); the dump refuses it before anything is launched."""
    for model_type in ("mixtral", "gemma2"):
        with pytest.raises(
            Unexpressible, match=f"backend=vllm cannot dump this capture: .*refuses model_type '{model_type}'"
        ):
            launch(typed_target(tmp_path, model_type), "vllm", [1, 2, 3])
        with pytest.raises(EngineRefused, match="does not support EAGLE3 interface"):
            StandinVllm(pretend(model_type), [1, 2, 3, N], tmp_path / "engine")
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,3,4]' in launch(typed_target(tmp_path, "qwen3"), "vllm", [1, 2, 3])


def test_vllm_backend_refuses_the_embeddings_of_deepseek_targets(tmp_path):
    target = typed_target(tmp_path, "deepseek_v3")
    with pytest.raises(Unexpressible, match="HF index 0 .*vLLM's DeepSeek code crashes on id 0"):
        launch(target, "vllm", [0, 2, 3])
    with pytest.raises(EngineRefused, match="residual is None at layer 0"):
        StandinVllm(pretend("deepseek_v3"), [0, 2, 3, N], tmp_path / "engine")
    assert '"eagle_aux_hidden_state_layer_ids":[1,2,3,4]' in launch(target, "vllm", [1, 2, 3])


def test_sglang_backend_takes_deepseek_and_gpt_oss_targets(tmp_path):
    """SGLang returns the post-norm final state for deepseek_v2 and gpt_oss targets as for llama;
    each family's id rule applies (DeepSeek: ids as written unless the first is 1; gpt_oss: +1)."""
    text = launch(typed_target(tmp_path, "deepseek_v3"), "sglang", [2, 3])
    assert "--return-aux-hidden-state-layer-ids 2 3" in text and "--enable-return-hidden-states" in text
    assert "--return-aux-hidden-state-layer-ids 0 1 2" in launch(typed_target(tmp_path, "gpt_oss"), "sglang", [1, 2, 3])
    with pytest.raises(Unexpressible, match="no rule covers target model_type 'mixtral'"):
        launch(typed_target(tmp_path, "mixtral"), "sglang", [1, 2, 3])


@pytest.mark.slow
def test_sglang_pipeline_stages_are_refused_before_launch(prepared, tmp_path):
    """SGLang returns aux hidden states only with pp_size == 1 (its stand-in refuses to start
    otherwise); extra engine flags asking for more stages stop print_launch and the launch script
    before any engine starts. Other flags go into both engine commands."""
    target = typed_target(tmp_path, "llama")
    for flags in ("--pp-size 2", "--tp-size 2 --pipeline-parallel-size=4"):
        with pytest.raises(
            ConfigError, match="pipeline stages, but SGLang returns aux hidden states only with pp_size == 1"
        ):
            launch(target, "sglang", [1, 2, 3], engine_args=flags)
    with pytest.raises(EngineRefused, match="requires pp_size == 1"):
        StandinSglang(build_tiny_model(), [0, 1, 2], pp_size=2)
    text = launch(target, "sglang", [1, 2, 3], engine_args="--tp-size 4 --pp-size 1")
    assert text.count("--tp-size 4 --pp-size 1") == 2
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        BACKEND="sglang",
        ENGINE_ARGS="--pp-size 2",
        EAGLE3_DUMP=f"{sys.executable} -m data_prep.dump",
    )
    run = subprocess.run(
        [
            "bash",
            str(repo / "launch" / "dump_served.sh"),
            f"target={target}",
            f"data={prepared}",
            f"out={tmp_path / 'dump'}",
            "capture.aux_indices=[1,2,3]",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "only with pp_size == 1" in run.stderr
    assert "the engine process ended (status 2) before the clients; stopping them" in run.stderr
    assert not (tmp_path / "dump" / "engine").exists()  # no engine was started


def test_every_printed_engine_command_parses_by_its_engines_flags(tmp_path):
    """print_launch's engine commands (the lines launch/dump_served.sh runs) parse back by the flags
    the engine's module knows, with the capture's ids where the engine reads them."""
    import shlex

    from eagle3_train.engines.registry import ENGINES

    target = typed_target(tmp_path, "llama")
    for backend, want in (("vllm", 2), ("sglang", 3)):
        text = launch(target, backend, [1, 2, 3], engine_args="--trust-remote-code")
        commands = [line for line in text.replace("\\\n", "").splitlines() if line and not line.startswith("#")][:-1]
        parsed = [ENGINES[backend].command.parse(shlex.split(c)) for c in commands]
        assert [p.get("--trust-remote-code") for p in parsed] == [True] * len(parsed)
        if backend == "vllm":
            (p,) = parsed
            assert p["model"] == str(target) and p["--no-enable-prefix-caching"] is True
            assert p["--speculative-config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
                1,
                2,
                3,
                N,
            ]
        else:
            aux, final = parsed
            assert aux["--return-aux-hidden-state-layer-ids"] == [0, 1, 2] and aux["--chunked-prefill-size"] == -1
            assert final["--enable-return-hidden-states"] is True and final["--port"] == 30001
        assert len(commands) + 1 == want  # the engine command(s), and the client's


def test_a_client_that_misses_its_sigterm_is_killed_after_the_grace(tmp_path):
    """The engine process ends first (its options refused), so dump_served.sh stops the clients; one
    whose SIGTERM is lost (here: it ignores it; in CI, one landed while Python imported) is killed
    STOP_GRACE_S later instead of holding the script forever. The engine's status is the script's."""
    import os
    import time
    from pathlib import Path

    fake = tmp_path / "dump.sh"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in\n'
        '  *" serve=true "*) sleep 1; exit 3 ;;\n'
        f"  *) echo $$ > {tmp_path / 'client.pid'}; trap '' TERM; exec sleep 300 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ, EAGLE3_DUMP=str(fake), STOP_GRACE_S="2")
    script = Path(__file__).resolve().parents[1] / "launch" / "dump_served.sh"
    began = time.monotonic()
    done = subprocess.run(["bash", str(script), "target=x"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "the engine process ended (status 3)" in done.stderr
    assert time.monotonic() - began < 30
    pid = int((tmp_path / "client.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
