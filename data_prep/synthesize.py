"""Conversations written entirely by the target: it asks the questions and answers them.

Many users have no chat data in their target's distribution, and the draft learns best from the
target's own text. Following Magpie (Xu et al., 2024), an instruction-tuned model that is shown
its chat template up to the point where a user message begins writes a plausible user message;
the target then answers it (the regeneration of ``data_prep.regenerate``), and a later user turn
is written the same way after the conversation so far.

**The user-turn prefix comes from the template itself**, as the loss mask does (no per-model
strings): the conversation so far plus a user message holding a unique sentinel is rendered; the
text before the sentinel is the prefix the target continues, and the special token that directly
follows the sentinel (whitespace aside) is the user turn's end-of-turn token, where sampling stops.

**Deterministic, resumable, parallel.** Conversation ``g`` belongs to chunk ``g // chunk_size``
(for a request smaller than one chunk, a smaller power of two: :func:`chunk_size_for`);
a chunk is generated in one piece, seeded by ``(seed, chunk)``, and saved atomically under
``<out>/synth/``. Which rank generates it does not matter: under torchrun, rank ``r`` takes the
chunks ``c`` with ``c % world == r``, and every rank then reads all chunks and applies the same
filters, so one rank and many give the same dataset. Chunks do not depend on the number of
conversations asked for (once it is at least ``EXPECTED_KEEP * chunk_size``), so a larger run reuses
a smaller one's chunks (copy its ``synth/``).

**Filters**, each counted: per user turn ``empty``, ``too_short``, ``too_long``,
``no_end_of_turn``, ``special_tokens``, ``repetition`` (a turn dropped at turn 0 drops the
conversation; at a later turn the conversation ends before it); then across the whole set, in
conversation order, ``exact_duplicate`` (same first user turn after case and whitespace
folding) and ``near_duplicate`` (MinHash LSH over word 3-grams, estimated Jaccard at or above
``near_duplicate_threshold``). If fewer than N conversations survive, more chunks are generated.

**Long-context conversations** (``synth.long_fraction`` f): evenly spread slots (conversation ``g``
is one when ``floor((g + 1) f) > floor(g f)``) hold a document followed by a task instead of a
question. The document is the target's own text: the replies of the same chunk's other
conversations, whole, in an order drawn by ``(seed, g)``, concatenated and cut at a length drawn
from ``synth.long_tokens`` (target tokens); the task is drawn from ``synth.long_tasks_file``. The
target answers it as it answers the questions (``regen.*``, one length-sorted batch per chunk).
They skip the user-turn and duplicate filters (their text is the target's replies, reused by
design); the selection takes ``round(N f)`` of them and ``N - round(N f)`` others, each in
conversation order.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from data_prep.chat import render_text
from data_prep.conversations import BadRow, Conversation
from data_prep.regenerate import RegenConfig, generate_sorted
from eagle3_train.core.errors import ConfigError, Eagle3Error, Interrupted, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fileio import atomic_write_json, remove_files, remove_temporaries, sha256_text
from eagle3_train.core.log import progress_bar
from eagle3_train.core.stagedir import StageDir

logger = logging.getLogger(__name__)

USER_FILTERS = ("empty", "too_short", "too_long", "no_end_of_turn", "special_tokens", "repetition")
SET_FILTERS = ("exact_duplicate", "near_duplicate")
MAX_ROUNDS = 8  # rounds of extra chunks when filters drop more than expected
EXAMPLE_CHARS = 300  # an example prompt longer than this is cut (a steering prompt, not a document)
EXAMPLES_HEADER = "Users write requests like these:"
LONG_TASKS_FILE = "long_tasks.txt"  # the shipped tasks of long-context conversations (data_prep/prompts/)
LONG_SEPARATOR = "\n\n"  # between a document's replies, and between the document and its task
LONG_MARGIN = 8  # tokens a cut document may gain when its text is tokenised again (merges at the cut)
LONG_KEYS = ("long_fraction", "long_tokens", "long_tasks_file")


@dataclass
class SynthConfig:
    """How the target writes user turns (``synthesize=N``); replies follow ``regen.*``."""

    turns: int = 1  # user turns per conversation (each answered by the target)
    system_prompts: list[str] | None = None  # steer topics: conversation g uses prompt g % len; null: none
    system_prompts_file: str | None = None  # the same, one prompt per line of a text file
    keep_system_prompt: bool = True
    """false: the system prompt steers the question only; the reply and the stored conversation go without it"""
    example_prompts_file: str | None = None
    """a prompt file (eagle3-eval's formats: your own users' prompts); each steering system prompt then lists examples_per_prompt of their first user turns (use with keep_system_prompt=false)"""
    examples_per_prompt: int = 3  # examples shown per conversation, drawn by (seed, conversation)
    starter_words: int = 0  # >0: the first user turn begins with the first this many words of the first example its system prompt lists, which the target continues ("Write", "What", "Explain" ...: the openings of your users' requests rather than the target's own); needs example_prompts_file
    temperature: float = 1.0  # sampling temperature of user turns
    top_p: float = 0.99  # nucleus mass of user turns
    max_new_tokens: int = 128  # longest user turn sampled (at most max_tokens + 1: past that a turn is dropped anyway); one that does not end by then is dropped (no_end_of_turn)
    min_tokens: int = 3  # shorter user turns are dropped (too_short)
    max_tokens: int = 100  # longer user turns are dropped (too_long)
    max_repeated_ngrams: float = 0.5  # drop a turn whose share of repeated word 4-grams exceeds this (repetition)
    near_duplicate_threshold: float = 0.8
    """estimated Jaccard of word 3-grams at which a first user turn is a near duplicate"""
    chunk_size: int = 512
    """conversations per resumable chunk under <out>/synth/ (fewer for a small synthesize=N: see chunk_size_for)"""
    long_fraction: float = 0.0
    """share of the conversations that are long-context: a document of the target's own replies (from the same chunk) followed by a task, answered as the others are (regen.*); 0: none"""
    long_tokens: list[int] = field(default_factory=lambda: [1000, 2000, 4000, 7000])
    """document lengths in target tokens, one drawn per long-context conversation by (seed, conversation); the longest must fit max_length and the target's context with the task and regen.max_new_tokens"""
    long_tasks_file: str | None = None
    """the tasks that follow a document, one per line, one drawn per long-context conversation by (seed, conversation); null: the shipped data_prep/prompts/long_tasks.txt"""

    def __post_init__(self) -> None:
        check_numbers(self, "synth.", positive=("turns", "max_new_tokens", "chunk_size", "examples_per_prompt"))
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ConfigError("synth.temperature must be > 0 and synth.top_p in (0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(
                f"synth.min_tokens ({self.min_tokens}) must be in 0..synth.max_tokens ({self.max_tokens})"
            )
        if not 0 < self.max_repeated_ngrams <= 1:
            raise ConfigError(f"synth.max_repeated_ngrams must be in (0, 1], got {self.max_repeated_ngrams}")
        if not 0 < self.near_duplicate_threshold <= 1:
            raise ConfigError(f"synth.near_duplicate_threshold must be in (0, 1], got {self.near_duplicate_threshold}")
        if self.system_prompts is not None and self.system_prompts_file is not None:
            raise ConfigError("give synth.system_prompts or synth.system_prompts_file, not both")
        if self.starter_words < 0:
            raise ConfigError(f"synth.starter_words must be >= 0, got {self.starter_words}")
        if self.starter_words and self.example_prompts_file is None:
            raise ConfigError(
                "synth.starter_words takes the openings of synth.example_prompts_file's prompts: give the file"
            )
        if not 0 <= self.long_fraction < 1:  # NaN fails too
            raise ConfigError(
                f"synth.long_fraction must be in [0, 1) (documents are cut from the other conversations' replies), "
                f"got {self.long_fraction}"
            )
        if not self.long_tokens or not all(type(t) is int and t > 0 for t in self.long_tokens):
            raise ConfigError(
                f"synth.long_tokens must be a non-empty list of positive token counts, got {self.long_tokens}"
            )

    def systems(self) -> list[str | None]:
        """The steering system prompts (``[None]``: no system message)."""
        if self.system_prompts_file is not None:
            path = Path(self.system_prompts_file).expanduser()
            if not path.is_file():
                raise ConfigError(f"synth.system_prompts_file {path} does not exist")
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not lines:
                raise ConfigError(f"synth.system_prompts_file {path} holds no prompt")
            return list(lines)
        if self.system_prompts is not None:
            if not self.system_prompts or not all(isinstance(s, str) and s.strip() for s in self.system_prompts):
                raise ConfigError("synth.system_prompts must be a non-empty list of non-empty strings (or null)")
            return list(self.system_prompts)
        return [None]

    def examples(self) -> list[str]:
        """The first user turns of ``example_prompts_file`` on one line each, at most
        EXAMPLE_CHARS characters (``[]`` without the file)."""
        if self.example_prompts_file is None:
            return []
        from eagle3_train.core.prompt_files import read_conversations

        path = Path(self.example_prompts_file).expanduser()
        if not path.exists():
            raise ConfigError(f"synth.example_prompts_file {path} does not exist")
        shown = [" ".join(c.turns[0].split())[:EXAMPLE_CHARS] for c in read_conversations(path) if c.turns]
        shown = [e for e in shown if e]
        if not shown:
            raise ConfigError(f"synth.example_prompts_file {path} holds no user prompt")
        return shown

    def long_tasks(self) -> list[str]:
        """The tasks of long-context conversations, one per non-empty line of ``long_tasks_file``
        (or the shipped file); ``[]`` when ``long_fraction`` is 0."""
        if not self.long_fraction:
            return []
        from eagle3_train.core.prompt_files import shipped_prompts

        path = Path(self.long_tasks_file).expanduser() if self.long_tasks_file else shipped_prompts(LONG_TASKS_FILE)
        if not path.is_file():
            raise ConfigError(f"synth.long_tasks_file {path} does not exist")
        tasks = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not tasks:
            raise ConfigError(f"synth.long_tasks_file {path} holds no task")
        return tasks


def recorded_synth(opts: dict[str, Any]) -> dict[str, Any]:
    """``synth.*`` as a request records it: without the long-context options while
    ``long_fraction`` is 0, so outputs made before they existed stay this run's."""
    if opts.get("long_fraction"):
        return dict(opts)
    return {k: v for k, v in opts.items() if k not in LONG_KEYS}


def long_prompt_tokens(tokenizer: Any, synth: SynthConfig) -> int:
    """The most tokens a long-context prompt can hold: the longest document (plus LONG_MARGIN),
    the longest task, the template with its generation prompt and, where it is kept, the longest
    steering prompt with its longest examples."""
    tasks = synth.long_tasks()
    system = None
    if synth.keep_system_prompt:
        systems = [s for s in synth.systems() if s is not None]
        examples = sorted(synth.examples(), key=len)[-synth.examples_per_prompt :]
        listed = EXAMPLES_HEADER + "\n" + "\n".join(f"- {e}" for e in examples) if examples else ""
        system = "\n\n".join(p for p in (max(systems, key=len) if systems else "", listed) if p) or None
    task = max(tasks, key=lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]))
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": LONG_SEPARATOR + task})
    text = render_text(tokenizer, messages, "synth.long_tasks", add_generation_prompt=True)
    return max(synth.long_tokens) + LONG_MARGIN + len(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- the template's user-turn prefix ---------------------------------------------------------------


@dataclass(frozen=True)
class UserTurnPrefix:
    """Where the target starts writing a user message, and the token that ends it."""

    text: str  # the rendering up to where the user message's content begins
    end_id: int  # the special token the template puts right after a user message
    after: str = ""  # the rendering after the user message's content


def split_at_user_turn(tokenizer: Any, history: list[dict]) -> tuple[str, str] | None:
    """The rendering of ``history`` + a user turn holding a fresh sentinel, as (before, after) the
    sentinel; None unless the sentinel appears exactly once. Raises BadRow when the template refuses."""
    sentinel = f"XEAGLE3USER{secrets.token_hex(6)}X"
    text = render_text(tokenizer, [*history, {"role": "user", "content": sentinel}], "synthesize")
    if text.count(sentinel) != 1:
        return None
    before, after = text.split(sentinel)
    return before, after


def user_turn_prefix(tokenizer: Any, history: list[dict], end_ids: set[int], template_name: str) -> UserTurnPrefix:
    """Derive the pre-query rendering of ``history`` + a new user turn from the chat template.

    Two renderings with different sentinels must agree up to the sentinel (else the template
    treats user content in a way no prefix can express), and a special token must follow the
    sentinel (else there is no token at which the user turn ends).

    Raises:
        Eagle3Error: naming ``template_name`` when either does not hold.
    """
    renders = []
    for _ in range(2):
        try:
            parts = split_at_user_turn(tokenizer, history)
        except BadRow as e:
            raise Eagle3Error(f"{template_name} refuses a conversation ending in a user turn: {e}") from None
        if parts is None:
            raise Eagle3Error(
                f"{template_name} does not place a user message verbatim once; its user-turn prefix cannot be derived"
            )
        renders.append(parts)
    (prefix, after), (prefix2, after2) = renders
    if prefix != prefix2 or after != after2:
        raise Eagle3Error(
            f"{template_name} renders the text around a user message differently for different "
            f"messages; its user-turn prefix cannot be derived"
        )
    enc = tokenizer(after, add_special_tokens=False, return_offsets_mapping=True)
    for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        if tid in end_ids:
            return UserTurnPrefix(prefix, int(tid), after)
        if after[a:b].strip():
            break
    raise Eagle3Error(
        f"{template_name} puts no special end-of-turn token after a user message (it continues with "
        f"{after[:40]!r}); synthesis needs one to stop the user turn. Pass chat_template= with a template that has one"
    )


# -- filters ----------------------------------------------------------------------------------------


def normalized(text: str) -> str:
    """Case and whitespace folded: the key of the exact-duplicate filter."""
    return " ".join(text.lower().split())


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """Share of word ``n``-grams that repeat an earlier one (0 when the text has fewer than 2n
    words: too short to call degenerate)."""
    words = text.lower().split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(words) < 2 * n:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def user_turn_problem(text: str, n_tokens: int, ended: bool, special: list[str], cfg: SynthConfig) -> str | None:
    """The filter that drops a sampled user turn, or ``None`` when it is kept."""
    if not ended:  # cut off: past max_tokens already (generation stops at max_tokens + 1), or at max_new_tokens
        return "too_long" if n_tokens > cfg.max_tokens else "no_end_of_turn"
    if not text:
        return "empty"
    if n_tokens < cfg.min_tokens:
        return "too_short"
    if n_tokens > cfg.max_tokens:
        return "too_long"
    if any(s in text for s in special):
        return "special_tokens"
    if repeated_ngram_share(text) > cfg.max_repeated_ngrams:
        return "repetition"
    return None


def shingles(text: str, n: int = 3) -> set[bytes]:
    words = re.findall(r"\w+", text.lower())
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + n]).encode() for i in range(len(words) - n + 1)}


class DuplicateFilter:
    """Which texts repeat an earlier kept one: ``exact_duplicate`` (folded text equal) or
    ``near_duplicate`` (MinHash estimate of word-3-gram Jaccard >= ``threshold``, candidates from
    datasketch's LSH). The first of a group is kept; order decides, so the result is deterministic.
    Texts may come in several calls (synthesis rounds): each continues the numbering and the state
    of the previous, so texts given in pieces are judged as if given at once."""

    def __init__(self, threshold: float, num_perm: int = 128, seed: int = 1) -> None:
        datasketch = optional_import("datasketch")

        self.threshold = threshold
        # LSH only proposes candidates (a lower threshold proposes more; datasketch needs >= 2 bands)
        self.lsh = datasketch.MinHashLSH(threshold=min(threshold, 0.9), num_perm=num_perm)
        self.blank = datasketch.MinHash(
            num_perm=num_perm, seed=seed
        )  # copies share its permutations (drawing them is slow)
        self.signatures: dict[int, Any] = {}
        self.seen: set[str] = set()
        self.count = 0

    def add(self, texts: list[str]) -> dict[int, str]:
        """The dropped ones among ``texts`` (indices counted over every call) and why."""
        dropped: dict[int, str] = {}
        for i, text in enumerate(texts, start=self.count):
            key = normalized(text)
            if key in self.seen:
                dropped[i] = "exact_duplicate"
                continue
            m = self.blank.copy()
            m.update_batch(sorted(shingles(text)))
            # LSH returns candidates; the estimate confirms (LSH alone has false positives)
            if any(m.jaccard(self.signatures[c]) >= self.threshold for c in self.lsh.query(m)):
                dropped[i] = "near_duplicate"
                continue
            self.seen.add(key)
            self.lsh.insert(i, m)
            self.signatures[i] = m
        self.count += len(texts)
        return dropped


# -- the stage --------------------------------------------------------------------------------------


MIN_CHUNK = 16
EXPECTED_KEEP = 0.8  # share of synthesized conversations the filters keep, to size a small first chunk


def chunk_size_for(n: int, chunk_size: int) -> int:
    """Conversations per chunk for ``synthesize=n``: ``chunk_size``, or for a request smaller than
    one chunk the power of two that holds ``n`` at the expected keep rate (at least MIN_CHUNK), so
    asking for 6 writes 16, not 512. Every request of at least ``EXPECTED_KEEP * chunk_size``
    conversations uses ``chunk_size`` itself and shares its chunks."""
    need = math.ceil(n / EXPECTED_KEEP)
    return min(chunk_size, max(MIN_CHUNK, 1 << max(0, need - 1).bit_length()))


def is_long(conv: Conversation) -> bool:
    """Whether a synthesized conversation is long-context (a document and a task)."""
    return "document_tokens" in conv.meta


def chunk_seed(seed: int, chunk: int) -> int:
    return (seed * 1_000_003 + chunk) % (2**63)


class Synthesizer:
    """Writes ``n`` conversations with the target, in chunks (module docstring).

    Args:
        n: conversations wanted.
        synth: user-turn options; regen: reply options (also the batch size of both).
        work_dir: ``<out>/synth``, where chunks are kept.
        request: what decides the chunks' content (options, target, seed), stored beside them; a
            different request is refused, naming each difference, unless ``overwrite``.
        load_model: a callable returning the target model and its end-of-turn ids (called only when
            a chunk is missing).
        tokenizer, special: the target's tokenizer and special ids; template_name names its template.
        rank, world: this process's place among the data-parallel ranks; barrier: waits for all.
        progress: the command's ``progress`` option (:func:`eagle3_train.core.log.progress_bar`).
    """

    def __init__(
        self,
        *,
        n: int,
        synth: SynthConfig,
        regen: RegenConfig,
        seed: int,
        work_dir: Path,
        request: dict[str, Any],
        overwrite: bool,
        load_model: Any,
        tokenizer: Any,
        special: set[int],
        template_name: str,
        rank: int = 0,
        world: int = 1,
        barrier: Any = None,
        progress: bool | None = True,
    ):
        if n <= 0:
            raise ConfigError(f"synthesize must be a positive number of conversations, got {n}")
        self.n, self.synth, self.regen, self.seed = n, synth, regen, seed
        self.size = chunk_size_for(n, synth.chunk_size)
        # the chunks' size decides which conversations share a batch (and its sampling): recorded
        request = {**request, "synth": {**request.get("synth", {}), "chunk_size": self.size}}
        self.dir, self.request, self.overwrite = work_dir, request, overwrite
        self.load_model, self.model = load_model, None
        self.eos: list[int] = []  # the generator's end ids, once it is loaded
        self.tok, self.template_name = tokenizer, template_name
        self.special_ids = special
        self.special_text = [t for t in tokenizer.all_special_tokens if t]
        self.rank, self.world, self.barrier = rank, world, barrier or (lambda: None)
        self.progress = progress
        self.systems = synth.systems()
        self.examples = synth.examples()
        self.long_tasks = synth.long_tasks()
        n_long = round(n * synth.long_fraction)
        self.wanted = {False: n - n_long, True: n_long}  # conversations to keep: short, long-context
        # a user turn is dropped once it passes max_tokens, so sampling stops one token after that
        self.user_cfg = replace(
            regen,
            max_new_tokens=min(synth.max_new_tokens, synth.max_tokens + 1),
            do_sample=True,
            temperature=synth.temperature,
            top_p=synth.top_p,
        )  # sampled, generated as the answers are
        self.generated: Counter[str] = Counter()  # new tokens and chunks this rank generated in this run
        self.totals: Counter[str] = (
            Counter()
        )  # new tokens and seconds of the chunks read so far, whichever run made them
        self.endings: dict[str, int] = {}  # what the template renders after a user message -> its end token (_prefix)
        # what _select has read and filtered so far (the chunks 0..chunks-1)
        self.selection: dict[str, Any] = {
            "chunks": 0,
            "kept": [],
            "counts": Counter(),
            "filter": DuplicateFilter(synth.near_duplicate_threshold),
        }

    # ---- chunks on disk
    def _claim_dir(self) -> None:
        if self.rank == 0:
            StageDir(
                self.dir,
                "synth",
                self.request,
                what="set of synthesized conversations",
                hint="pass overwrite=true to discard them, or choose another out=",
                exclusive=True,
            ).claim(replace=self.overwrite, clear=lambda: remove_files(self.dir, "chunk-*.json"))
            remove_temporaries(self.dir)  # a chunk killed before its rename (the other ranks wait below)
        self.barrier()

    def steering(self, g: int) -> tuple[str | None, str]:
        """Conversation ``g``'s system prompt and the words its first user turn begins with. The
        prompt: steering prompt ``g % len``, then, with ``synth.example_prompts_file``,
        ``examples_per_prompt`` of its examples drawn by ``(seed, g)`` (so which rank writes the
        conversation, or how many are asked for, does not matter). The words: the first
        ``synth.starter_words`` of the first example listed ("" without them)."""
        system = self.systems[g % len(self.systems)]
        if not self.examples:
            return system, ""
        picked = random.Random(f"{self.seed}:{g}").sample(
            self.examples, min(self.synth.examples_per_prompt, len(self.examples))
        )
        listed = EXAMPLES_HEADER + "\n" + "\n".join(f"- {e}" for e in picked)
        starter = " ".join(picked[0].split()[: self.synth.starter_words])
        return listed if system is None else f"{system}\n\n{listed}", starter

    def long_slot(self, g: int) -> bool:
        """Whether conversation ``g`` is long-context: the slots are spread evenly, so any run of
        conversations holds the share ``synth.long_fraction`` of them (to one)."""
        f = self.synth.long_fraction
        return math.floor((g + 1) * f) > math.floor(g * f)

    def _path(self, chunk: int) -> Path:
        return self.dir / f"chunk-{chunk:06d}.json"

    def run(self) -> tuple[list[Conversation], dict[str, Any]]:
        """All ranks return the same conversations (the first ``n`` that pass every filter, in
        conversation order) and statistics. Ctrl-C names the chunks kept."""
        try:
            return self._run()
        except KeyboardInterrupt:
            kept = len(list(self.dir.glob("chunk-*.json")))
            raise Interrupted(
                f"synthesis stopped; {kept} finished chunks are kept under {self.dir} and are not generated again"
            ) from None

    def _run(self) -> tuple[list[Conversation], dict[str, Any]]:
        for system in self.systems:  # a template without a derivable prefix fails before any work
            self._prefix({"system": system, "messages": []})
        self._claim_dir()
        size = self.size
        n_chunks = -(-self.n // size)
        start = time.perf_counter()
        for round_ in range(MAX_ROUNDS):
            # a rank with no chunk left this round makes the next one (a round's wall time is its
            # busiest rank's anyway); it is read only when a later round asks for it, so the
            # dataset and the counts do not depend on the number of ranks
            for c in range(-(-n_chunks // self.world) * self.world):
                if c % self.world == self.rank and not self._path(c).is_file():
                    self._generate_chunk(c)
            self.barrier()
            kept, counts = self._select(n_chunks)
            if not kept:
                raise Eagle3Error(
                    f"every synthesized conversation of {n_chunks} chunk(s) was dropped ({dict(counts)}); "
                    f"e.g. raise synth.max_new_tokens / synth.max_tokens if the target writes long questions, "
                    f"or check that the target is a chat model"
                )
            have = Counter(map(is_long, kept))
            short = [kind for kind, want in self.wanted.items() if have[kind] < want]
            if not short or round_ == MAX_ROUNDS - 1:
                break
            # more chunks for the largest deficit at its keep rate so far (plus a margin), at most 4x
            rates = {kind: max(have[kind], 1) / (n_chunks * size) for kind in short}
            need = max(int((self.wanted[kind] - have[kind]) / rates[kind] * 1.1) for kind in short)
            n_chunks += min(3 * n_chunks, max(1, -(-need // size)))
        seconds = time.perf_counter() - start
        taken: Counter[bool] = Counter()  # the first wanted of each kind, in conversation order
        chosen = []
        for conv in kept:
            if taken[kind := is_long(conv)] < self.wanted[kind]:
                chosen.append(conv)
                taken[kind] += 1
        if len(chosen) < self.n:
            logger.warning(
                f"eagle3-prepare: only {len(chosen)} of {self.n} synthesized conversations passed the filters "
                f"after {n_chunks} chunks; see counts.synthesis in the manifest"
            )
        stats = {
            "conversations_asked": self.n,
            "conversations_kept": len(chosen),
            "chunks": n_chunks,
            "dropped": dict(counts),
            "new_tokens": self.totals["new_tokens"],  # every chunk's, whichever run made it
            "chunk_seconds": round(self.totals["seconds"], 3),
            "this_run_new_tokens": self.generated["tokens"],  # this rank, this run
            "this_run_wall_s": round(seconds, 3),
        }
        if self.synth.long_fraction:
            lengths = Counter(conv.meta["document_tokens"] for conv in chosen if is_long(conv))
            stats["long_context"] = {
                "asked": self.wanted[True],
                "kept": taken[True],
                "document_tokens": {str(k): lengths[k] for k in sorted(lengths)},
            }
            logger.info(
                f"eagle3-prepare: {taken[True]} of {len(chosen)} synthesized conversations are long-context "
                f"(documents of {', '.join(f'{k} tokens: {v}' for k, v in sorted(lengths.items()))})"
            )
        return chosen, stats

    def _select(self, n_chunks: int) -> tuple[list[Conversation], Counter]:
        """The conversations of chunks 0..n_chunks-1 that pass the set filters, and every filter's
        count. A later round's chunks follow the earlier ones, so each call reads and filters only
        the chunks added since the last."""
        sel = self.selection
        for c in range(sel["chunks"], n_chunks):
            data = json.loads(self._path(c).read_text())
            sel["counts"].update(data["dropped"])
            self.totals.update(new_tokens=data["new_tokens"], seconds=data["seconds"])
            convs = [Conversation(d["messages"], d["source"], d["meta"]) for d in data["conversations"]]
            # long-context ones skip the duplicate filter: their documents reuse the replies by design
            short = [i for i, conv in enumerate(convs) if not is_long(conv)]
            start = sel["filter"].count
            dropped = sel["filter"].add(
                [next(m["content"] for m in convs[i].messages if m["role"] == "user") for i in short]
            )
            sel["counts"].update(Counter(dropped.values()))
            gone = {short[i - start] for i in dropped}
            sel["kept"].extend(conv for i, conv in enumerate(convs) if i not in gone)
        sel["chunks"] = max(sel["chunks"], n_chunks)
        return list(sel["kept"]), Counter(sel["counts"])

    # ---- generation
    @torch.no_grad()
    def _generate_chunk(self, chunk: int) -> None:
        if self.model is None:
            self.model, self.eos = self.load_model()
            self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        t0 = time.perf_counter()
        torch.manual_seed(chunk_seed(self.seed, chunk))
        size = self.size
        ids = range(chunk * size, (chunk + 1) * size)
        # per conversation: the messages kept, the system prompt that steers its user turns
        # long-context slots wait for the others' replies (their documents) and are answered last
        convs: list[dict[str, Any]] = [
            {"id": g, "system": system, "starter": starter, "messages": [], "alive": not self.long_slot(g)}
            for g, (system, starter) in zip(ids, map(self.steering, ids))
        ]
        longs = [c for c in convs if not c["alive"]]
        dropped: Counter = Counter()
        new_tokens = 0
        bar = progress_bar(
            total=(len(convs) - len(longs)) * self.synth.turns * 2 + len(longs),
            desc=f"synthesize chunk {chunk}",
            unit="turn",
            show=self.progress,
        )
        for turn in range(self.synth.turns):
            alive = [c for c in convs if c["alive"]]
            if not alive:
                break
            # 1. the user turn, sampled from the template's pre-query rendering
            prefixes = [self._prefix(c) for c in alive]
            # one call for the batch: the Rust tokenizer spreads it over the CPUs
            starts = [c["starter"] if turn == 0 else "" for c in alive]
            prompts = self.tok([p.text + s for p, s in zip(prefixes, starts)], add_special_tokens=False)["input_ids"]
            stops = sorted(set(self.eos) | {p.end_id for p in prefixes})
            outs, _ = generate_sorted(
                self.model,
                prompts,
                self.user_cfg,
                stops,
                self.pad,
                bar=bar,
                seed=chunk_seed(self.seed, chunk) + 2 * turn,
            )
            for c, reply, start in zip(alive, outs, starts):
                ended = len(reply) < self.user_cfg.max_new_tokens  # the stop token is never part of a reply
                new_tokens += len(reply) + ended
                text = (start + self.tok.decode(reply, skip_special_tokens=False)).strip()
                problem = user_turn_problem(text, len(reply), ended, self.special_text, self.synth)
                if problem is not None:
                    dropped[problem] += 1
                    c["alive"] = False
                    if turn == 0:
                        c["messages"] = []
                    continue
                c["messages"].append({"role": "user", "content": text})
            # 2. the target's answer, as regeneration writes it
            alive = [c for c in convs if c["alive"]]
            new_tokens += self._answer(alive, chunk_seed(self.seed, chunk) + 2 * turn + 1, bar, dropped)
        if longs:
            new_tokens += self._answer_long(longs, convs, chunk, bar, dropped)
        bar.close()
        self._save_chunk(chunk, convs, dropped, new_tokens, time.perf_counter() - t0)

    def _save_chunk(
        self, chunk: int, convs: list[dict[str, Any]], dropped: Counter, new_tokens: int, seconds: float
    ) -> None:
        """The chunk's surviving conversations and counts, written atomically."""
        kept = [
            {
                "messages": self._stored(c),
                "source": f"synthesized[{c['id']}]",
                "meta": {
                    "id": c["id"],
                    **({"system_prompt": c["system"]} if c["system"] is not None else {}),
                    **({"document_tokens": c["document_tokens"]} if "document_tokens" in c else {}),
                },
            }
            for c in convs
            if c["messages"]
        ]
        atomic_write_json(
            self._path(chunk),
            {"conversations": kept, "dropped": dict(dropped), "new_tokens": new_tokens, "seconds": round(seconds, 3)},
        )
        self.generated.update(tokens=new_tokens, chunks=1)
        fault_point("synth.chunk")  # tests: a kill at the worst moment, other ranks mid-chunk

    def _draw_document(self, g: int, pieces: list[str], sizes: list[int]) -> tuple[str, int, str]:
        """Conversation ``g``'s draws by ``(seed, g)``: ``pieces`` (the chunk's replies, each with
        its separator) whole, in a drawn order (again from the start where they run out), joined
        until their tokens (``sizes``, counted apart) exceed the drawn length of ``synth.long_tokens``
        by a margin (joined text tokenises a few percent otherwise); that text, the length and a task."""
        rng = random.Random(f"{self.seed}:long:{g}")
        length = rng.choice(self.synth.long_tokens)
        task = rng.choice(self.long_tasks)
        order = rng.sample(range(len(pieces)), len(pieces))
        return self._join(pieces, sizes, order, length), length, task

    @staticmethod
    def _join(pieces: list[str], sizes: list[int], order: list[int], tokens: int) -> str:
        """``pieces`` in ``order`` (cycled) until their sizes pass ``tokens`` by 10% + 16."""
        text, n, i = [], 0, 0
        while n < tokens * 1.1 + 16:  # every piece holds at least its separator's token
            text.append(pieces[order[i % len(order)]])
            n += sizes[order[i % len(order)]]
            i += 1
        return "".join(text)

    def _answer_long(self, longs: list[dict], convs: list[dict], chunk: int, bar: Any, dropped: Counter) -> int:
        """Write the long-context conversations ``longs``: a document of the replies of this
        chunk's other conversations (``convs``), a task, and the target's answer (``regen.*``, one
        length-sorted batch, seeded by the chunk). Returns the new tokens generated."""
        replies = [m["content"] for c in convs for m in c["messages"] if m["role"] == "assistant"]
        if not replies:  # every other conversation of the chunk was dropped
            dropped["no_document"] += len(longs)
            bar.update(len(longs))
            return 0
        pieces = [r + LONG_SEPARATOR for r in replies]
        sizes = [len(ids) for ids in self.tok(pieces, add_special_tokens=False)["input_ids"]]
        drawn = [self._draw_document(c["id"], pieces, sizes) for c in longs]
        # the joined texts tokenised in one call (the Rust tokenizer spreads it over the CPUs), then
        # cut at the drawn length: the document holds that many tokens of the target's own text
        joined = self.tok([text for text, _, _ in drawn], add_special_tokens=False)["input_ids"]
        for c, (text, length, task), ids in zip(longs, drawn, joined):
            while len(ids) < length:  # tokenised together, far fewer tokens than apart: join more
                text += self._join(pieces, sizes, list(range(len(pieces))), length - len(ids))
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
            doc = self.tok.decode(ids[:length], skip_special_tokens=False).strip()
            c["document_tokens"] = length
            c["messages"] = [{"role": "user", "content": doc + LONG_SEPARATOR + task}]
        return self._answer(longs, chunk_seed(self.seed, chunk) + 2 * self.synth.turns, bar, dropped)

    def _answer(self, convs: list[dict], seed: int, bar: Any, dropped: Counter) -> int:
        """The target's reply to the last user turn of each of ``convs``, as regeneration writes it
        (``regen.*``, length-sorted batches, ``seed``); an empty reply ends its conversation before
        that turn. Returns the new tokens generated."""
        texts = [render_text(self.tok, self._stored(c), f"synth[{c['id']}]", add_generation_prompt=True) for c in convs]
        prompts = self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        outs, _ = generate_sorted(self.model, prompts, self.regen, self.eos, self.pad, bar=bar, seed=seed)
        new_tokens = 0
        for c, reply in zip(convs, outs):
            new_tokens += len(reply) + (len(reply) < self.regen.max_new_tokens)
            c["messages"].append(
                {"role": "assistant", "content": self.tok.decode(reply, skip_special_tokens=False).strip()}
            )
            if not c["messages"][-1]["content"]:
                dropped["empty_reply"] += 1
                c["messages"] = c["messages"][:-2]
                c["alive"] = False
        return new_tokens

    def _stored(self, c: dict) -> list[dict]:
        """The conversation as stored and answered: with its system prompt unless it only steers."""
        if c["system"] is None or not self.synth.keep_system_prompt:
            return list(c["messages"])
        return [{"role": "system", "content": c["system"]}, *c["messages"]]

    def _prefix(self, c: dict) -> UserTurnPrefix:
        """:func:`user_turn_prefix` of the conversation so far. Its two renderings and the search for
        the end token run once per kind of ending (what follows the user message); after that, one
        rendering whose ending is one already derived gives the same prefix."""
        history = ([{"role": "system", "content": c["system"]}] if c["system"] is not None else []) + c["messages"]
        try:
            parts = split_at_user_turn(self.tok, history)
        except BadRow:
            parts = None  # the full derivation names the template's complaint
        if parts is not None and parts[1] in self.endings:
            return UserTurnPrefix(parts[0], self.endings[parts[1]], parts[1])
        p = user_turn_prefix(self.tok, history, self.special_ids, self.template_name)
        self.endings[p.after] = p.end_id
        return p


def template_name(target: str, template: str) -> str:
    """How errors name a chat template: the target and the template's hash."""
    return f"the chat template of target {target} (sha256 {sha256_text(template)[:12]})"
