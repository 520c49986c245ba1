"""``eagle3-prepare``: conversations -> ``input_ids`` + assistant ``loss_mask`` (a datasets dataset).

    eagle3-prepare target=embedded input=chats.jsonl out=/data/run/prepared
    eagle3-prepare target=embedded synthesize=2048 out=/data/run/synth      # the target writes the chats
    torchrun --nproc_per_node 8 -m data_prep.prepare target=<hf dir> synthesize=500000 out=...

Output ``<out>/dataset/`` (``datasets.load_from_disk``) with columns ``sample_id`` (row id, used by
every later stage), ``input_ids`` (int32), ``loss_mask`` (uint8), ``num_tokens``,
``num_loss_tokens``, ``source`` (``file:line`` of the input row); and ``<out>/manifest.json``,
written last. Run again with the same options, it reuses the finished output; with other options,
it refuses unless ``overwrite=true``. With ``regenerate=true`` the finished chunks under
``<out>/regen/`` survive a crash and are not generated again; with ``synthesize=N`` those under
``<out>/synth/`` (``data_prep.synthesize``), on any number of ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from data_prep.chat import (
    REASONING_OFF,
    RENDER_MODES,
    Rendered,
    TurnSample,
    reasoning_when_off,
    render_conversation,
    special_ids,
    thinking_off,
)
from data_prep.conversations import BadRow, Conversation, input_fingerprint, iter_raw_rows, normalize
from data_prep.graph_decode import CACHE_SHARE
from data_prep.regenerate import RegenConfig, regenerate
from data_prep.synthesize import SynthConfig, Synthesizer, long_prompt_tokens, recorded_synth, template_name
from eagle3_train.core.cli import as_typed, config_dict, entry_point
from eagle3_train.core.contract import check_dtype
from eagle3_train.core.dist import DistInfo, barrier, close, init_distributed, resolve_device
from eagle3_train.core.errors import ConfigError, Eagle3Error, Interrupted, check_numbers
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fileio import (
    atomic_write_bytes,
    atomic_write_json,
    remove_files,
    remove_temporaries,
    sha256_json,
)
from eagle3_train.core.log import LogConfig, progress_bar
from eagle3_train.core.reasoning import check_template_kwargs, markers_for
from eagle3_train.core.split import COPY_SHIFT, MAX_COPIES, copy_id
from eagle3_train.core.stagedir import StageDir, hold_lock
from eagle3_train.core.tokenizer_spec import tokenizer_facts
from eagle3_train.engines import registry
from eagle3_train.targets import Target, chat_template_of, eos_ids, load_target, text_config

logger = logging.getLogger(__name__)

STAGE = "prepare"
BAD_ROW_POLICIES = ("error", "skip")
EXAMPLES_PER_REASON = 5
TOKENIZE_PER_WORKER = 10_000  # conversations per tokenising process when tokenize_workers=0
MAX_TOKENIZE_WORKERS = 32  # ... and at most this many (each imports torch and transformers)


@dataclass
class PrepareConfig:
    """Options of ``eagle3-prepare`` (``conf/prepare.yaml``)."""

    target: str = "embedded"  # embedded | tiny | HF directory | hub id | .gguf file
    input: str | None = None  # .jsonl/.json file, directory of them, saved dataset, or hub dataset id
    out: str = MISSING  # output directory (dataset/ + manifest.json)
    synthesize: int | None = None  # instead of input: N conversations written by the target itself (see synth.*)
    synth: SynthConfig = field(default_factory=SynthConfig)
    save_conversations: str | None = None
    """also write the final conversations (after regeneration) as .jsonl or .jsonl.gz"""
    split: str = "train"  # split to read when input is a hub dataset id
    cache_dir: str | None = None  # where GGUF targets are converted once (never the working dir)
    chat_template: str | None = None  # replaces the tokenizer's template: a .jinja file or the text
    chat_template_kwargs: Any = None
    """flags passed to the chat template at every render, as engines take chat_template_kwargs (e.g. chat_template_kwargs.enable_thinking=false for Qwen3, .thinking=true for DeepSeek-V3.1, .reasoning_effort=high for gpt-oss); recorded with the target's identity, carried to the export, and compared by eval, check and served acceptance"""
    render: str = "auto"
    """auto: a conversation is one sample when every assistant turn's served request (the template's render of the messages before it, with the generation prompt) and reply continue its render, else one sample per assistant turn, rendered as the engine renders that turn's request (a template that drops earlier reasoning); whole: such conversations are bad rows (template_rewrites_history); per_turn: every conversation per turn"""
    max_length: int = 2048  # longest tokenised conversation kept
    truncate: bool = True  # cut longer conversations to max_length (false: they are bad rows)
    reasoning_off: str = "drop"
    """a reply's reasoning (inline <think>…</think>answer, or a reasoning_content / reasoning / thinking field) where the template renders with thinking off (its generation prompt closes the reasoning block, e.g. chat_template_kwargs.enable_thinking=false): drop it, as the engine's replies have none, or keep it inline after the template's empty block; counted and warned about either way"""
    on_bad_row: str = "error"  # error: stop at the first bad row; skip: count it and go on
    tokenize_workers: int = 0  # processes that tokenise the conversations; 0: one per 10,000 conversations, at most the CPUs this process may use and 32 (one, in this process, below 20,000)
    limit: int | None = None  # read only the first N rows of the input
    sample_id_offset: int = 0  # first sample id (give datasets to be merged later disjoint ranges)
    repeat: int = 1
    """each conversation written this many times (after regeneration, so the copies share one reply; copy r's sample id is the original's + r * 2**48, and copies share its train/eval split): weights a small set of your own prompts beside a larger dataset it is merged with at eagle3-standardize"""
    regenerate: bool = False  # the target rewrites every assistant turn (see regen.*)
    regen: RegenConfig = field(default_factory=RegenConfig)
    device: str = "auto"  # where the target runs for regeneration (auto: cuda if present)
    dtype: str = "auto"  # target dtype for regeneration (auto: float32 on CPU, bfloat16 on GPU)
    seed: int = 0  # sampling seed (regen.do_sample=true)
    overwrite: bool = False  # replace an existing output made with other options
    trust_remote_code: bool = False  # let transformers run the target repository's own code
    progress: bool | None = None
    """null: a bar on a terminal, else a progress line every logging.progress_every_s seconds; true: a bar always; false: neither"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        check_dtype(self.dtype, auto=True)
        check_template_kwargs(self.chat_template_kwargs)
        if self.render not in RENDER_MODES:
            raise ConfigError(f"render must be one of {RENDER_MODES}, got {self.render!r}")
        if self.reasoning_off not in REASONING_OFF:
            raise ConfigError(f"reasoning_off must be one of {REASONING_OFF}, got {self.reasoning_off!r}")
        if self.on_bad_row not in BAD_ROW_POLICIES:
            raise ConfigError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {self.on_bad_row!r}")
        check_numbers(
            self,
            positive=("max_length", "limit", "synthesize", "repeat"),
            non_negative=("sample_id_offset", "tokenize_workers"),
        )
        if self.repeat >= MAX_COPIES or self.sample_id_offset >= 1 << COPY_SHIFT:
            raise ConfigError(
                f"repeat must be below {MAX_COPIES} and sample_id_offset below 2**{COPY_SHIFT} (sample ids number "
                f"copies above that bit), got repeat={self.repeat}, sample_id_offset={self.sample_id_offset}"
            )
        if self.save_conversations is not None and not self.save_conversations.endswith((".jsonl", ".jsonl.gz")):
            raise ConfigError(
                f"save_conversations must name a .jsonl or .jsonl.gz file, got {self.save_conversations!r}"
            )
        if (self.input is None) == (self.synthesize is None):
            raise ConfigError("give input=<conversations> or synthesize=<number of conversations>, exactly one")


ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


@dataclass
class Row:
    """One sample to write: its conversation, the assistant turn it holds (None: all of them) and
    its ids and mask."""

    conversation: Conversation
    turn: int | None
    rendered: Rendered

    @property
    def source(self) -> str:
        """Where the sample came from: the input row, and its turn when rendered per turn."""
        where = self.conversation.source
        return where if self.turn is None else f"{where} turn {self.turn + 1}"


class BadRows:
    """Applies ``on_bad_row``: raise at once, or count per reason and keep a few examples."""

    def __init__(self, policy: str):
        self.policy = policy
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def handle(self, err: BadRow) -> None:
        if self.policy == "error":
            raise Eagle3Error(f"{err} (on_bad_row=skip would skip such rows and count them)")
        self.counts[err.reason] += 1
        examples = self.examples.setdefault(err.reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(str(err))

    def summary(self) -> str:
        lines = [f"  {reason}: {n} (e.g. {self.examples[reason][0]})" for reason, n in self.counts.most_common()]
        return f"skipped {sum(self.counts.values())} bad rows:\n" + "\n".join(lines)


class Preparer:
    """Runs the prepare stage: read -> (regenerate) -> render + mask -> write."""

    def __init__(self, cfg: PrepareConfig):
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.bad = BadRows(cfg.on_bad_row)
        # synthesis runs data-parallel under torchrun; everything else is one process
        # synthesis ranks only meet at barriers: several may share a GPU (generation is bound by per-step overhead)
        self.dist = (
            init_distributed(cfg.device, share_gpus=True)
            if cfg.synthesize
            else DistInfo(0, 1, 0, resolve_device(cfg.device))
        )
        self.target: Target = self._load(load_model=False)  # the weights only to generate
        if chat_template_of(self.target.tokenizer) is None:
            raise Eagle3Error(
                f"the tokenizer of target {cfg.target} has no chat template; pass "
                f"chat_template=<file.jinja or template text>"
            )
        self._check_lengths()
        self.request = {
            "config": self._output_options(),
            "target": self.target.identity.to_dict(),
            "input": input_fingerprint(cfg.input) if cfg.input is not None else "synthesized",
        }
        self.fingerprint = sha256_json(self.request)  # names this output in the dump's request
        self.dir = StageDir(
            self.out,
            STAGE,
            self.request,
            what="prepared dataset",
            hint="pass overwrite=true to replace it, or choose another out=",
        )

    def _check_lengths(self) -> None:
        """Generated lengths against the target's context and max_length, before any work: a reply
        can never be longer than either (regen.max_new_tokens=10000000 once ran for 11 minutes)."""
        c = self.cfg
        if not (c.regenerate or c.synthesize):
            return
        context = getattr(text_config(self.target.config), "max_position_embeddings", None)
        limits = [("regen.max_new_tokens", c.regen.max_new_tokens)]
        if c.synthesize:
            limits.append(("synth.max_new_tokens", c.synth.max_new_tokens))
        for name, value in limits:
            if context is not None and value >= context:
                raise ConfigError(
                    f"{name}={value} does not fit the target's context of {context} tokens (with the "
                    f"prompt before it): lower it"
                )
            if value > c.max_length:
                raise ConfigError(
                    f"{name}={value} is longer than max_length={c.max_length}, where every conversation "
                    f"is cut: lower {name} or raise max_length"
                )
        if c.synthesize and c.synth.long_fraction:
            # the longest document, its task and template, and the reply: never cut where it is written or kept
            need = long_prompt_tokens(self.target.tokenizer, c.synth) + c.regen.max_new_tokens
            longest = (
                f"synth.long_tokens up to {max(c.synth.long_tokens)} + the task, template and regen.max_new_tokens"
            )
            if context is not None and need > context:
                raise ConfigError(
                    f"{longest} make {need} tokens, more than the target's context of {context}: lower synth.long_tokens"
                )
            if need > c.max_length:
                raise ConfigError(
                    f"{longest} make {need} tokens, more than max_length={c.max_length}, where every conversation is "
                    f"cut: raise max_length (to at least {need}) or lower synth.long_tokens"
                )

    def _load(self, load_model: bool) -> Target:
        c = self.cfg
        return load_target(
            c.target,
            cache_dir=c.cache_dir,
            load_model=load_model,
            dtype=c.dtype,
            device=str(self.dist.device),
            chat_template=c.chat_template,
            chat_template_kwargs=c.chat_template_kwargs,
            trust_remote_code=c.trust_remote_code,
        )

    def _output_options(self, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The options that decide the output (not where it goes or how fast it is made), of this
        run or of a ``config`` recorded in a manifest."""
        opts = dict(config if config is not None else config_dict(self.cfg))
        for key in (
            "out",
            "overwrite",
            "cache_dir",
            "device",
            "progress",
            "logging",
            "save_conversations",
            "tokenize_workers",
        ):
            opts.pop(key, None)
        if not (opts.get("regenerate") or opts.get("synthesize")):
            opts.pop("regen", None)
        else:  # where the engine listens and how the client retries do not change a reply
            opts["regen"] = {k: v for k, v in opts["regen"].items() if k != "server"}
            if (
                opts["regen"].get("memory_share", CACHE_SHARE) == CACHE_SHARE
                or opts["regen"].get("batching") != "graph"
            ):
                opts["regen"].pop("memory_share", None)  # splits only graph batches; outputs made before it stay valid
        if not opts.get("synthesize"):
            opts.pop("synth", None)
        elif "synth" in opts:
            opts["synth"] = recorded_synth(opts["synth"])
        for key, defaults in (
            ("repeat", (1,)),
            ("render", ("auto",)),
            ("chat_template_kwargs", (None, {})),
            ("reasoning_off", ("drop",)),
        ):
            if opts.get(key, defaults[0]) in defaults:  # outputs made before the option existed stay this run's
                opts.pop(key, None)
        return opts

    def run(self) -> dict[str, Any] | None:
        # A finished output is only read, by any number of runs at once (several trainings reuse one
        # synthesis); out='s lock is taken before writing: here when the output is unfinished or
        # overwrite= may remove it, else at the first write (a refused input leaves nothing).
        if self.out.is_dir() and (self.cfg.overwrite or not self.dir.recorded()):
            self._hold()
        # rank 0 decides (and may remove a manifest under overwrite) before the others look
        done = self._finished_output() if self.dist.is_main else None
        barrier()
        if not self.dist.is_main:
            done = self._finished_output()
        if done is not None:
            if self.cfg.save_conversations:
                raise ConfigError(
                    f"{self.out} is already prepared with these options, and save_conversations= writes only while "
                    f"preparing: choose another out= (copy {self.out}/synth or {self.out}/regen there to reuse "
                    f"what was generated)"
                )
            logger.info(f"eagle3-prepare: {self.out} is already prepared with these options; reusing it")
            return done
        # Synthesis: the tokenising processes start now and get ready while the target writes (on
        # the GPU machine, started after it they took ~55 s to begin, recipe_starter_h200x2.json;
        # started before, 0.06 s, recipe_parts_h200x2.json); rank 0 tokenises.
        pool = self._tokenizing_pool(self.cfg.synthesize) if self.cfg.synthesize and self.dist.is_main else None
        try:
            if self.cfg.synthesize:
                conversations, regen_stats = self.synthesize()
                rows_read = len(conversations)
                if not self.dist.is_main:
                    return None  # rank 0 writes the dataset
            else:
                conversations, rows_read = self.read()
                regen_stats = {}
            if self.cfg.regenerate:
                conversations, more = self.regenerate(conversations)
                regen_stats |= more
            conversations, reasoning_off = self.reasoning_rule(conversations)
            rows, stats = self.render(conversations, pool)
            stats["reasoning_with_thinking_off"] = reasoning_off
        finally:
            if pool is not None:
                pool[0].shutdown(cancel_futures=True)
        if self.cfg.save_conversations:  # each conversation once, whatever repeat=
            save_conversations(
                list({id(r.conversation): r.conversation for r in rows}.values()),
                Path(self.cfg.save_conversations).expanduser(),
            )
        # copy r of conversation i: sample id offset + i + r * 2**COPY_SHIFT (sample_ids)
        return self.write(rows, stats | {"rows_read": rows_read}, regen_stats)

    def _tokenizing_pool(self, n: int) -> tuple[ProcessPoolExecutor, int] | None:
        """``tokenize_workers`` processes (0: one per 10,000 of ``n`` conversations, at most the CPUs
        and 32), started now, and their number; None where this process tokenises alone."""
        import multiprocessing

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # not on macOS
        workers = min(self.cfg.tokenize_workers or min(cpus, MAX_TOKENIZE_WORKERS, n // TOKENIZE_PER_WORKER), n)
        if workers <= 1:
            return None
        pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_tokenizing_process,
            initargs=(self.target.tokenizer,),
        )
        for _ in range(workers):  # a submission starts a process while none is idle
            pool.submit(os.getpid)
        return pool, workers

    def synthesize(self) -> tuple[list[Conversation], dict]:
        """The target writes ``synthesize`` conversations (``data_prep.synthesize``)."""
        c = self.cfg
        tok = self.target.tokenizer
        request = {  # what decides the chunks' content: not N, not how the result is tokenised
            "target": self.target.identity.to_dict(),
            "seed": c.seed,
            "dtype": c.dtype,
            # the steering prompts themselves, not the file they came from
            "synth": recorded_synth(config_dict(c.synth))
            | {
                "system_prompts": c.synth.systems(),
                "system_prompts_file": None,
                "example_prompts": c.synth.examples(),
                "example_prompts_file": None,
            }
            | ({"long_tasks": c.synth.long_tasks(), "long_tasks_file": None} if c.synth.long_fraction else {}),
            "regen": {k: v for k, v in self._output_options()["regen"].items() if k != "chunk_size"},
        }
        assert c.synthesize is not None  # how this method is reached: synthesize=N
        self._hold()
        synthesizer = Synthesizer(
            n=c.synthesize,
            synth=c.synth,
            regen=c.regen,
            seed=c.seed,
            work_dir=self.out / "synth",
            request=request,
            overwrite=c.overwrite,
            load_model=self._load_generator,
            tokenizer=tok,
            special=special_ids(tok),
            template_name=template_name(c.target, chat_template_of(tok) or ""),
            rank=self.dist.rank,
            world=self.dist.world_size,
            barrier=barrier,
            progress=c.progress if self.dist.is_main else False,
        )
        conversations, stats = synthesizer.run()
        if self.dist.world_size > 1:  # torchrun's ranks are done together; rank 0 writes the dataset alone
            close()
        return conversations, {"synthesis": stats}

    def _load_generator(self) -> tuple[Any, list[int]]:
        """The target's weights (``None`` when an engine serves it: ``regen.backend``) and its
        end-of-turn ids; loaded only when something is generated."""
        if self.target.model is None and registry.ENGINES[self.cfg.regen.backend].in_process:
            self.target = self._load(load_model=True)
        return self.target.model, sorted(eos_ids(self.target.model, self.target.tokenizer, self.target.local_dir))

    def _hold(self) -> None:
        """Take out='s lock before writing in it (one prepare at a time: a second is refused, naming
        the first) and remove a killed run's unrenamed temporary files."""
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            hold_lock(self.out, "prepared dataset")
            remove_temporaries(self.out)

    def _finished_output(self) -> dict[str, Any] | None:
        """A finished output of these options, input and target; another is refused, or removed
        under ``overwrite``."""
        return self.dir.finished(replace=self.cfg.overwrite)

    def read(self) -> tuple[list[Conversation], int]:
        """Normalise the input rows; bad rows follow ``on_bad_row``."""
        assert self.cfg.input is not None  # PrepareConfig: input= or synthesize=N, and read() is for input=
        conversations, rows_read = [], 0
        for source, row in iter_raw_rows(self.cfg.input, self.cfg.split):
            if self.cfg.limit is not None and rows_read >= self.cfg.limit:
                break
            rows_read += 1
            try:
                conversations.append(normalize(row, source, need_assistant=not self.cfg.regenerate))
            except BadRow as e:
                self.bad.handle(e)
        if rows_read == 0:
            raise Eagle3Error(f"input {self.cfg.input} holds no rows")
        return conversations, rows_read

    def regenerate(self, conversations: list[Conversation]) -> tuple[list[Conversation], dict]:
        """Regenerate in chunks of ``regen.chunk_size``; finished chunks are kept on disk."""
        import torch

        self._hold()
        regen_dir = self.out / "regen"
        # chunks of other options or input: never mixed, always replaced
        StageDir(regen_dir, "regen", self.request).claim(
            replace=True, clear=lambda: remove_files(regen_dir, "chunk-*.json")
        )
        remove_temporaries(regen_dir)  # a chunk killed before its rename (this process holds out=)
        model, eos = self._load_generator()
        tok = self.target.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        size = self.cfg.regen.chunk_size
        out, unfinished = [], 0
        n_chunks = (len(conversations) + size - 1) // size
        try:
            for c in range(n_chunks):
                path = regen_dir / f"chunk-{c:05d}.json"
                if path.is_file():
                    data = json.loads(path.read_text())
                    chunk = [Conversation(d["messages"], d["source"], d["meta"]) for d in data["conversations"]]
                else:
                    torch.manual_seed(self.cfg.seed + c)
                    logger.info(f"regenerating chunk {c + 1}/{n_chunks}")
                    try:
                        chunk, n_cut = regenerate(
                            model,
                            tok,
                            conversations[c * size : (c + 1) * size],
                            self.cfg.regen,
                            eos_ids=eos,
                            pad_id=pad,
                            progress=self.cfg.progress,
                            seed=self.cfg.seed + c,
                        )
                    except Eagle3Error as e:
                        if registry.ENGINES[self.cfg.regen.backend].in_process:  # no engine to name
                            raise
                        raise self._engine_stopped(e, c, n_chunks, regen_dir) from None
                    data = {"unfinished": n_cut, "conversations": [vars(x) for x in chunk]}
                    atomic_write_json(path, data)
                    fault_point("regen.chunk")
                out.extend(chunk)
                unfinished += data["unfinished"]
        except KeyboardInterrupt:
            kept = len(list(regen_dir.glob("chunk-*.json")))
            raise Interrupted(
                f"regeneration stopped; {kept} of {n_chunks} chunks are kept under {regen_dir} and are not "
                f"generated again"
            ) from None
        cut = sum(bool(c.meta.get("cut_in_reasoning")) for c in out)
        turns = sum(m["role"] == "assistant" for c in out for m in c.messages)
        stats = {"turns_hit_max_new_tokens": unfinished, "conversations_cut_in_reasoning": cut, "turns": turns}
        return out, stats

    def reasoning_rule(self, conversations: list[Conversation]) -> tuple[list[Conversation], int | None]:
        """Where the template renders with thinking off, every reply's reasoning, inline or in a
        field, follows ``reasoning_off`` (:func:`data_prep.chat.reasoning_when_off`); the replies
        that carried some are counted (None: thinking is not off)."""
        markers = markers_for(chat_template_of(self.target.tokenizer), None)
        if not thinking_off(self.target.tokenizer, markers):
            return conversations, None
        assert markers is not None  # thinking_off needs them
        out, count = [], 0
        for c in conversations:
            messages, n = reasoning_when_off(c.messages, markers, self.cfg.reasoning_off)
            out.append(Conversation(messages, c.source, c.meta) if n else c)
            count += n
        if count:
            what = "dropped" if self.cfg.reasoning_off == "drop" else "kept inline after the template's empty block"
            other = "keep" if self.cfg.reasoning_off == "drop" else "drop"
            logger.warning(
                f"warning: {count} replies carry reasoning (inline or in a reasoning field) while the template "
                f"renders with thinking off, where the engine's replies have none: {what} "
                f"({as_typed(f'reasoning_off={other}')} would {other} it)"
            )
        return out, count

    def _engine_stopped(self, error: Eagle3Error, chunk: int, n_chunks: int, regen_dir: Path) -> Eagle3Error:
        """A served engine's failure, naming the engine, its URL and the chunks kept."""
        r = self.cfg.regen
        kept = len(list(regen_dir.glob("chunk-*.json")))
        return Eagle3Error(
            f"regeneration through {r.backend} at regen.server.url={r.server.url} stopped in chunk "
            f"{chunk + 1} of {n_chunks}: {error}\n  the {kept} finished chunks are kept under "
            f"{regen_dir}; once the engine answers again, run the same command to resume"
        )

    def render(
        self, conversations: list[Conversation], pool: tuple[ProcessPoolExecutor, int] | None = None
    ) -> tuple[list[Row], dict]:
        """Tokenise every conversation with its loss mask, in ``pool`` (started earlier) or in the
        ``tokenize_workers`` processes :meth:`_tokenizing_pool` starts now."""
        tok = self.target.tokenizer
        opts: dict[str, Any] = dict(
            regenerate=self.cfg.regenerate and self.cfg.regen.cut_in_reasoning,
            max_length=self.cfg.max_length,
            truncate=self.cfg.truncate,
            end_ids=special_ids(tok, eos_ids(self.target.model, tok)),
            mode=self.cfg.render,
        )
        bar = progress_bar(total=len(conversations), desc="tokenize", unit="conv", show=self.cfg.progress)
        began = time.time()
        own = pool is None
        if own:
            pool = self._tokenizing_pool(len(conversations))
        timing: dict[str, Any] = {"processes": pool[1] if pool else 1, "started_before": bool(pool) and not own}
        if pool is None:
            rendered = [render_one(tok, conv, **opts) for conv in conversations]
            bar.update(len(conversations))
        else:
            executor, workers = pool
            rendered, starts = [], []
            size = -(-len(conversations) // (workers * 4))  # a few slices per worker: the bar moves
            slices = [conversations[i : i + size] for i in range(0, len(conversations), size)]
            try:
                for started, part in executor.map(_render_slice, slices, [opts] * len(slices)):
                    rendered.extend(part)
                    starts.append(started)
                    bar.update(len(part))
            finally:
                if own:
                    executor.shutdown(cancel_futures=True)
            # how long the processes took to start (import, tokenizer) against the tokenising itself
            timing |= {
                "first_slice_began_s": round(min(starts) - began, 2),
                "last_slice_began_s": round(max(starts) - began, 2),
            }
        bar.close()
        timing["seconds"] = round(time.time() - began, 2)
        rows, truncated = [], 0
        per_turn = {"conversations": 0, "samples": 0, "tokens": 0, "tokens_whole": 0, "shared_prefix_tokens": 0}
        for conv, got in zip(conversations, rendered):
            if isinstance(got, BadRow):
                self.bad.handle(got)
                continue
            samples, cost = got
            kept = []
            for sample in samples:
                if isinstance(sample.rendered, BadRow):
                    self.bad.handle(sample.rendered)
                    continue
                truncated += sample.rendered.truncated
                kept.append(Row(conv, sample.turn, sample.rendered))
            if cost:
                per_turn["conversations"] += 1
                per_turn["samples"] += len(kept)
                for key in ("tokens", "tokens_whole", "shared_prefix_tokens"):
                    per_turn[key] += cost[key]
            rows.extend(kept)
        if not rows:
            raise Eagle3Error(f"no usable conversation in {self.cfg.input}; {self.bad.summary()}")
        return rows, {"truncated": truncated, "tokenize": timing, "per_turn": per_turn}

    def sample_ids(self, rows: list[Row]) -> np.ndarray:
        """The ids of the written rows (``repeat`` copies of ``rows``): offset + the conversation's
        number, its copy's number above :data:`~eagle3_train.core.split.COPY_SHIFT` and its
        assistant turn's above :data:`~eagle3_train.core.split.TURN_SHIFT` where it is rendered per
        turn (copies and turns share their conversation's train/eval split)."""
        first = np.array([i == 0 or rows[i].conversation is not rows[i - 1].conversation for i in range(len(rows))])
        conversation = np.cumsum(first) - 1
        if self.cfg.sample_id_offset + int(conversation[-1]) + 1 > 1 << COPY_SHIFT:
            raise ConfigError(
                f"sample_id_offset={self.cfg.sample_id_offset} + {int(conversation[-1]) + 1} conversations passes "
                f"2**{COPY_SHIFT}, where sample ids number copies (repeat=): choose a smaller sample_id_offset"
            )
        turn = np.array([r.turn or 0 for r in rows], dtype=np.int64)
        base = self.cfg.sample_id_offset + conversation.astype(np.int64)
        return np.concatenate([np.asarray(copy_id(base, copy, turn)) for copy in range(self.cfg.repeat)])

    def write(self, rows: list[Row], stats: dict, regen_stats: dict) -> dict[str, Any]:
        """Save the dataset (``repeat`` copies of ``rows``), then the manifest (last, atomically)."""
        import pyarrow as pa
        from datasets import Dataset

        sample_ids = self.sample_ids(rows)
        rows = rows * self.cfg.repeat
        lengths = np.array([len(r.rendered.input_ids) for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32 if lengths.sum() < 2**31 else np.int64)
        list_type = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray
        ids = np.concatenate([r.rendered.input_ids for r in rows])
        mask = np.concatenate([r.rendered.loss_mask for r in rows])
        loss_tokens = np.array([int(r.rendered.loss_mask.sum()) for r in rows], dtype=np.int32)
        table = pa.table(
            {
                "sample_id": pa.array(sample_ids),
                "input_ids": list_type.from_arrays(offsets, ids),
                "loss_mask": list_type.from_arrays(offsets, mask),
                "num_tokens": pa.array(lengths.astype(np.int32)),
                "num_loss_tokens": pa.array(loss_tokens),
                "source": pa.array([r.source for r in rows]),
            }
        )
        self._hold()
        dataset_dir = self.out / "dataset"
        if dataset_dir.exists():
            shutil.rmtree(dataset_dir)
        Dataset(table).save_to_disk(str(dataset_dir))
        counts = {
            "rows_read": stats["rows_read"],
            "rows_written": len(rows),
            "tokens": int(lengths.sum()),
            "loss_tokens": int(loss_tokens.sum()),
            "truncated": stats["truncated"],
            "skipped": dict(self.bad.counts),
        }
        if stats.get("reasoning_with_thinking_off") is not None:  # replies whose reasoning reasoning_off decided
            counts["reasoning_with_thinking_off"] = stats["reasoning_with_thinking_off"]
        if stats["per_turn"]["conversations"]:
            # what rendering as served cost: tokens of the turn samples against the conversations rendered once
            counts["per_turn"] = stats["per_turn"]
        body = {
            "fingerprint": self.fingerprint,
            "target": self.target.identity.to_dict(),
            "tokenizer": tokenizer_facts(self.target.tokenizer),  # (explains a tokenizer_hash that differs later)
            "config": config_dict(self.cfg),
            "dataset": "dataset",
            "counts": counts,
            "skipped_examples": self.bad.examples,
            "regeneration": regen_stats or None,
            "tokenize": stats.get("tokenize"),  # wall seconds, and when the processes began (not a count)
        }
        manifest = self.dir.write_manifest(body)
        logger.info(
            f"eagle3-prepare: {len(rows)} conversations, {counts['tokens']} tokens "
            f"({counts['loss_tokens']} assistant), {counts['truncated']} truncated -> {dataset_dir}"
        )
        if self.bad.counts:
            logger.info(self.bad.summary())
        for line in self.unlearnable(counts, regen_stats):
            logger.warning(line)
        return manifest

    def unlearnable(self, counts: dict[str, Any], regen_stats: dict[str, Any]) -> list[str]:
        """One warning line per way most of the data is cut short: samples cut at ``max_length``
        (the draft never sees their ends), replies cut at ``regen.max_new_tokens`` (it learns
        replies that stop mid-sentence), each counted with the option that helps."""
        lines = []
        rows, cut = counts["rows_written"], counts["truncated"] * self.cfg.repeat
        if rows and 2 * cut > rows:
            context = getattr(text_config(self.target.config), "max_position_embeddings", None)
            lines.append(
                f"warning: {cut} of {rows} samples ({100 * cut // rows}%) were cut at max_length={self.cfg.max_length}: "
                f"the draft never learns their ends; raise {as_typed('max_length')}"
                + (f" (the target's context holds {context} tokens)" if context else "")
            )
        turns, hit = regen_stats.get("turns", 0), regen_stats.get("turns_hit_max_new_tokens", 0)
        if turns and 2 * hit > turns:
            lines.append(
                f"warning: {hit} of {turns} regenerated replies ({100 * hit // turns}%) stopped at "
                f"regen.max_new_tokens={self.cfg.regen.max_new_tokens} before their end of turn: the draft learns "
                f"replies cut mid-way; raise {as_typed('regen.max_new_tokens')}"
            )
        return lines


def save_conversations(conversations: list[Conversation], path: Path) -> None:
    """OpenAI-form JSONL (gzip for ``.gz``): the conversations as rendered, e.g. a synthesized
    corpus to ship or to prepare again under another template."""
    import gzip

    lines = "".join(json.dumps({"messages": c.messages, **c.meta}, ensure_ascii=False) + "\n" for c in conversations)
    data = lines.encode()
    atomic_write_bytes(path, gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    logger.info(f"eagle3-prepare: {len(conversations)} conversations -> {path}")


def render_one(
    tok: Any,
    conv: Conversation,
    *,
    regenerate: str | bool,
    max_length: int,
    truncate: bool,
    end_ids: set[int],
    mode: str,
) -> tuple[list[TurnSample], dict[str, int]] | BadRow:
    """One conversation's samples (one, or one per assistant turn: data_prep.chat) and what
    rendering them per turn cost, or the BadRow that says why it cannot be used. ``regenerate``:
    false, or regen.cut_in_reasoning (drop | keep) for regenerated conversations."""
    try:
        if regenerate:
            _check_regenerated(conv)
            if regenerate == "drop" and conv.meta.get("cut_in_reasoning"):
                raise BadRow(
                    conv.source,
                    "cut_in_reasoning",
                    "a regenerated reply hit regen.max_new_tokens inside its reasoning (regen.cut_in_reasoning=keep "
                    "keeps such conversations)",
                )
        samples, cost = render_conversation(
            tok, conv.messages, conv.source, max_length=max_length, truncate=truncate, end_ids=end_ids, mode=mode
        )
        for s in samples:
            if isinstance(s.rendered, BadRow):
                s.rendered = s.rendered.with_traceback(None)
        return samples, cost
    except BadRow as e:
        return e.with_traceback(None)  # kept until all are rendered: not the frames of its tokenisation


_WORKER: dict[str, Any] = {}  # a tokenising process's tokenizer


def _tokenizing_process(tok: Any) -> None:
    # One conversation per call: the Rust tokenizer's own thread pool (one thread per CPU, in every
    # worker) would only oversubscribe the CPUs the workers already fill.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group: the parent stops the pool, a worker says nothing
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(tok=tok)


def _render_slice(conversations: list[Conversation], opts: dict[str, Any]) -> tuple[float, list[Any]]:
    """When this process began the slice (wall clock), and the slice rendered."""
    return time.time(), [render_one(_WORKER["tok"], conv, **opts) for conv in conversations]


def _check_regenerated(conv: Conversation) -> None:
    for i, m in enumerate(conv.messages):
        if m["role"] == "assistant" and not m["content"]:
            raise BadRow(conv.source, "empty_regeneration", "the target replied with nothing", f"messages[{i}]")


main = entry_point("prepare", PrepareConfig, lambda cfg: Preparer(cfg).run())

if __name__ == "__main__":
    main()
