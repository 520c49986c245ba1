"""The options of ``eagle3-train`` (``conf/train.yaml``): typed sections and their checks, and the
learning-rate schedule they define."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.log import LogConfig
from eagle3_train.engines.heads import FLAG_NAMES
from eagle3_train.training.objective import Objective
from eagle3_train.training.online import OnlineConfig, PreparedConfig
from eagle3_train.training.served import EngineConfig
from eagle3_train.training.tracking import TRACKERS, check_tracker

SCHEDULES = ("cosine", "linear", "constant", "wsd")  # optim.schedule's values
OPTIMIZERS = ("adamw", "muon")  # optim.optimizer's values
SOURCES = ("offline", "online", "served")  # source's values
USUAL_CHAIN = 5  # draft tokens per verify step that eagle3-eval and the engines' recipes use


@dataclass
class ObjectiveConfig:
    """What each step's loss measures (``objective.*``; through eagle3-run ``train.objective.*``)."""

    ttt_length: int = 7  # training-time-test steps unrolled
    loss_decay: float = 0.8  # weight of step j is loss_decay**j
    lk_weight: float = 0.0  # w in the step loss (1 - w) * soft cross-entropy + w * -log sum_v min(p_v, q_v), the LK term that targets speculative sampling's acceptance rate (0: the plain soft cross-entropy)
    label_smoothing: float = 0.0
    """e: the loss compares the draft with (1 - e) * the target distribution + e / draft vocab size"""
    min_target_prob: float = 0.0  # a position enters the loss only where the target's top probability over the draft vocab reaches this (accuracy still counts every position)

    def __post_init__(self) -> None:
        if self.ttt_length < 1:
            raise ConfigError(f"objective.ttt_length must be >= 1, got {self.ttt_length}")
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"objective.loss_decay must be in (0, 1], got {self.loss_decay}")
        objective(self)  # its checks


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule (``optim.*``; through eagle3-run ``train.optim.*``)."""

    lr: float = 1e-4  # peak learning rate (AdamW; with optimizer=muon, of the parameters Muon leaves to AdamW)
    optimizer: str = "adamw"
    """adamw | muon: Muon (momentum orthogonalized by Newton-Schulz; DeepSpeed's, every ZeRO stage) on the draft's weight matrices (fc, attention, MLP) at optim.muon_lr, AdamW at optim.lr on the rest (norms, lm_head)"""
    muon_lr: float = 0.02  # optimizer=muon: the matrices' peak learning rate (Muon's own scale, about 10x AdamW's; the same warmup and decay as optim.lr)
    muon_momentum: float = 0.95  # optimizer=muon: Muon's momentum (Nesterov)
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak
    warmup_steps: int = 0  # linear warmup from 0
    warmup_fraction: float = 0.0
    """linear warmup over this share of the run's total steps instead of a fixed count (at least one step; the total is the one the schedule decays over, so a run of fewer epochs or a budget in minutes warms up for fewer steps; 0: off, warmup_steps counts)"""
    schedule: str = "cosine"  # decay after warmup: cosine | linear | constant | wsd (warmup-stable-decay: the peak lr until the last optim.decay_fraction of the steps, then a linear decay)
    decay_fraction: float = 0.2  # schedule=wsd: the share of the steps after warmup that decay to min_lr_ratio
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 0.5  # max global gradient norm (0: off; not applied with optimizer=muon, where DeepSpeed would clip Muon's orthogonalized update instead of the gradient)
    lm_head_steps: int = 0  # the draft's lm_head trains for the first N optimizer steps only, then its lr is 0: frozen after a warm-up (0: it trains at every step; model.freeze_lm_head: never)
    ema_decay: float = 0.0  # evaluate and export an exponential moving average of the weights with this decay per optimizer step (0: off; e.g. 0.999; ZeRO 0-2)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optim.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not self.muon_lr > 0:
            raise ConfigError(f"optim.muon_lr must be > 0, got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"optim.ema_decay must be in [0, 1), got {self.ema_decay}")
        if not self.lr > 0:  # also refuses nan
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"optim.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.warmup_fraction and self.warmup_steps:
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps} and optim.warmup_fraction={self.warmup_fraction} both set "
                "the warmup: keep one (the other 0)"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        check_numbers(self, "optim.", non_negative=("warmup_steps", "weight_decay", "grad_clip", "lm_head_steps"))


@dataclass
class LoopConfig:
    """How long the run is, on what batches, and how often it logs and evaluates (``loop.*``;
    through eagle3-run ``train.loop.*``)."""

    epochs: int = 1  # passes over the training split
    max_steps: int | None = None  # stop after this many optimizer steps (null: all epochs)
    min_steps: int = 0
    """the epochs take at least this many optimizer steps: where they hold fewer at loop.max_tokens_per_batch (little data, few epochs), the micro-batches' token budget shrinks to the largest that gives this many (samples are still cut at loop.max_tokens_per_batch; counted up to loop.max_steps, so a shorter run keeps its batches; a budget in minutes may end the run sooner; 0: off)"""
    max_minutes: float | None = None
    """wall-clock budget of the training loop in minutes (evaluations inside it count; start-up, the final evaluation and save do not): from the rate measured at each logged step and every 10 steps the total is sized so the lr schedule ends when the minutes do; the run ends at whichever comes first, the epochs, max_steps or the minutes (null: no budget)"""
    max_tokens_per_batch: int = 8192  # padded tokens in one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    seed: int = 0  # data order and initialisation
    log_every: int = 10  # metrics line every N steps
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    early_stop_patience: int = 0
    """stop after this many evaluations without a better eval simulated tau (0: off; needs loop.eval_every)"""

    def __post_init__(self) -> None:
        for name in ("epochs", "max_tokens_per_batch", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"loop.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"loop.max_steps must be >= 1 or null, got {self.max_steps}")
        if self.min_steps < 0:
            raise ConfigError(f"loop.min_steps must be >= 0 (0: off), got {self.min_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"loop.max_minutes must be > 0 or null, got {self.max_minutes}")
        if self.early_stop_patience < 0:
            raise ConfigError(f"loop.early_stop_patience must be >= 0, got {self.early_stop_patience}")
        if self.early_stop_patience and not self.eval_every:
            raise ConfigError("loop.early_stop_patience counts evaluations: set loop.eval_every too")
        check_numbers(self, "loop.", non_negative=("eval_every",))


@dataclass
class CheckpointConfig:
    """What the run keeps on disk, and how often (``checkpoint.*``; through eagle3-run ``train.checkpoint.*``)."""

    every_minutes: float = 10.0
    """checkpoint when this many minutes of training have passed since the last checkpoint (or the loop's start), so a kill loses at most this much work and a rerun continues from it (0: off; checked every step on one process, every 10 steps on several)"""
    save_every: int = 0  # also checkpoint every N steps (0: off)
    keep_last: int = 2  # checkpoints kept
    keep_best: bool = False  # keep the checkpoint with the best eval simulated tau (saved when it improves, never deleted by keep_last, the one eagle3-export takes)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        check_numbers(self, "checkpoint.", non_negative=("save_every", "every_minutes"))


@dataclass
class RuntimeConfig:
    """How the steps run on the hardware; none changes what is learned (``runtime.*``; through
    eagle3-run ``train.runtime.*``)."""

    head_chunk: int = 4096  # positions per chunk of the fused draft lm_head + soft cross-entropy: no step's [T, V_draft] logits are kept (0: whole logits through autograd; ZeRO-3 needs 0)
    activation_checkpointing: bool = False  # recompute each TTT step's decoder layer in backward instead of keeping its activations (long sequences; ~1/3 more layer FLOPs)
    compile: bool = False  # torch.compile the decoder layer's step-independent parts (2 graphs per grad mode) and the fused head loss's chunk math (GPU; the first steps compile)
    sequence_parallel: int = 1  # ranks that share each sequence (Ulysses all-to-all over heads); divides the world size and the head counts; data parallelism runs over world / this
    cache_target_gb: float = 0.0  # keep each sample's target distribution in memory after its first use, up to this size (0: recompute every epoch)
    cudnn_attention: bool = False  # let torch run attention (SDPA: the draft's and, online, the target's) on cuDNN where it prefers it (H100/H200); false: FlashAttention or the memory-efficient kernel. cuDNN builds a graph for each new sequence shape, and packed batches change shape every step: under torch.profiler the recipe's step spent 85 ms (8k-token batches) to 140-176 ms (32k) of a ~0.23 s step's host time there (benchmarks/results/step_profile_h200.json)

    def __post_init__(self) -> None:
        if self.sequence_parallel < 1:
            raise ConfigError(f"runtime.sequence_parallel must be >= 1, got {self.sequence_parallel}")
        check_numbers(self, "runtime.", non_negative=("head_chunk", "cache_target_gb"))


def objective(o: ObjectiveConfig) -> Objective:
    """The step loss ``objective.*`` defines (:class:`eagle3_train.training.objective.Objective`)."""
    return Objective(o.lk_weight, o.label_smoothing, o.min_target_prob)


# model.variant -> the head's normalisation flags it sets (a flag given as true or false wins).
# EAGLE-3.1 (the EAGLE-3.1 paper; the engines' fc_norm and norm_output): each aux state through its
# own RMSNorm before fc, and each chain step after the first fed the previous step's normed output.
VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}


@dataclass
class ModelOptions:
    """Recipe options of the draft head (``model.*``); its shapes come from the target."""

    variant: str = "eagle3"
    """eagle3 | eagle3.1: the head's normalisation as the field names it (eagle3.1: fc_norm and norm_output on); the four flags below, when set, win over it"""
    lm_head_init: str = "random"  # random | target: start lm_head from the target lm_head's rows of the draft vocab (and norm from the target's final norm)
    freeze_lm_head: bool = False  # keep lm_head at its initial value (needs lm_head_init=target)
    aux_norm: bool | None = (
        None  # one RMSNorm over the concatenated aux states before fc (the engines' norm_before_fc, weight input_norm); null: as model.variant sets it
    )
    fc_norm: bool | None = (
        None  # one RMSNorm per aux state before fc (the engines' fc_norm); null: as model.variant sets it
    )
    norm_before_residual: bool | None = (
        None  # the layer's residual is the normed hidden state rather than the raw one (vLLM computes it, SGLang does not); null: as model.variant sets it
    )
    norm_output: bool | None = (
        None  # chain steps after the first take the previous step's output through the final norm (the engines' norm_output); null: as model.variant sets it
    )
    intermediate_size: int = 0  # the draft MLP's width; 0: the target's (engines read it from the exported config.json)

    def head_flags(self) -> dict[str, Any]:
        """The four normalisation flags of the head: ``variant``'s, then each one set explicitly."""
        preset = VARIANTS[self.variant]
        return {f: bool(preset.get(f, False) if getattr(self, f) is None else getattr(self, f)) for f in FLAG_NAMES}

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"model.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.lm_head_init not in ("random", "target"):
            raise ConfigError(f"model.lm_head_init must be random or target, got {self.lm_head_init!r}")
        if self.freeze_lm_head and self.lm_head_init != "target":
            raise ConfigError("model.freeze_lm_head=true would freeze a random lm_head: set model.lm_head_init=target")
        if self.intermediate_size < 0:
            raise ConfigError(f"model.intermediate_size must be >= 0 (0: the target's), got {self.intermediate_size}")


@dataclass
class DeepSpeedConfig:
    """How DeepSpeed shards the run (``deepspeed=zero1|zero2|zero3``)."""

    zero_stage: int = 1  # ZeRO stage 0-3
    bf16: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; true / false to force
    offload_optimizer: bool = False  # ZeRO optimizer states in host memory
    check_grad_overflow: bool = True
    """bf16: DeepSpeed looks for inf/NaN gradients each step and skips such a step, the host waiting for the GPU there; false: no look and no wait (a non-finite loss stops the run, and each save checks the weights first, so no checkpoint keeps non-finite ones)"""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass
class LoggingConfig(LogConfig):
    """The console (:class:`~eagle3_train.core.log.LogConfig`) and where metrics go besides
    metrics.jsonl (``logging=none|wandb|tensorboard``). A wandb setting left null is read from its
    ``WANDB_*`` variable; one set here wins over the variable."""

    tracker: str = "none"  # none | wandb (logging=wandb) | tensorboard (logging=tensorboard: <out>/tensorboard, needs the tensorboard package)
    wandb_project: str | None = None  # the wandb project (null: $WANDB_PROJECT, else eagle3_train)
    wandb_entity: str | None = None  # the wandb entity (null: $WANDB_ENTITY, else wandb's default)
    wandb_mode: str | None = None
    """online | offline | disabled (null: $WANDB_MODE, else offline; disabled writes nothing)"""
    run_name: str | None = None  # the wandb run's name (null: $WANDB_NAME, else the run directory's name)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tracker not in TRACKERS:
            raise ConfigError(f"logging.tracker must be one of {', '.join(TRACKERS)}, got {self.tracker!r}")
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ConfigError(f"logging.wandb_mode must be online, offline or disabled, got {self.wandb_mode!r}")
        check_tracker(self.tracker)


@dataclass
class TrainConfig:
    """Options of ``eagle3-train`` (``conf/train.yaml``)."""

    data: str = MISSING  # source=offline: a standardized directory (eagle3-standardize's out); source=online: a prepared one (eagle3-prepare's out)
    target: str = "embedded"  # the target whose embeddings and lm_head are read (offline: from its safetensors only; online: it runs in the loop)
    source: str = "offline"
    """offline: states read from data=; online: the target runs on data= in the training loop (prepared.*, online.*); served: engine replicas (vLLM, SGLang) return the states of data= (prepared.*, engine.*)"""
    prepared: PreparedConfig = field(default_factory=PreparedConfig)
    """source=online and served: which layers, the draft vocab and the held-out split of the prepared data="""
    online: OnlineConfig = field(default_factory=OnlineConfig)
    """source=online: how the target runs in this process"""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """source=served: the engine replicas that return the target's states"""
    out: str = MISSING  # run directory
    cache_dir: str | None = None  # where GGUF targets are converted once
    resume: str = "auto"  # auto: continue from the last checkpoint in out; never: refuse a used out
    overwrite: bool = False  # start over: remove out's checkpoints, metrics and record of an earlier run (of these options or others) before training
    device: str = "auto"  # auto: cuda:<local_rank> if present, else cpu
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """the console and the metrics tracker (logging=none|wandb|tensorboard)"""
    progress: bool | None = None
    """null: a bar on a terminal, else a progress line every logging.progress_every_s seconds; true: a bar always; false: neither"""

    def __post_init__(self) -> None:
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"resume must be auto or never, got {self.resume!r}")
        if self.source not in SOURCES:
            raise ConfigError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "offline" and self.prepared != PreparedConfig():
            raise ConfigError(
                "prepared.* options read a prepared dataset (source=online or served); offline, the standardized "
                "data= holds the capture, the vocab map and the split"
            )
        if self.source != "online" and self.online != OnlineConfig():
            raise ConfigError(
                "online.* options set how the target runs in this process (source=online)"
                + (
                    "; with source=served the engine runs it (engine.dtype, engine.engine_args)"
                    if self.source == "served"
                    else ""
                )
            )
        if self.source != "served" and self.engine != EngineConfig():
            raise ConfigError(
                "engine.* options apply to source=served (states from engine replicas); add source=served"
            )
        if self.deepspeed.zero_stage == 3 and self.runtime.head_chunk:
            raise ConfigError(
                "runtime.head_chunk reads lm_head's weight outside its module, which ZeRO-3 does not gather: "
                "set runtime.head_chunk=0 with deepspeed=zero3"
            )
        if self.deepspeed.zero_stage == 3 and self.optim.ema_decay:
            raise ConfigError("optim.ema_decay averages whole weights, which ZeRO-3 partitions: use ZeRO 0-2")
        if self.optim.optimizer == "muon" and self.deepspeed.offload_optimizer:
            raise ConfigError(
                "optim.optimizer=muon runs on the GPU beside the gradients; deepspeed.offload_optimizer keeps the "
                "optimizer in host memory: choose one"
            )
        if self.optim.lm_head_steps and self.model.freeze_lm_head:
            raise ConfigError(
                "optim.lm_head_steps trains lm_head for its first steps, model.freeze_lm_head never: choose one"
            )


# The sections one ``train.*`` section held until the options were split by concern: an old key is
# refused with its new name (``optim.lr`` -> ``optim.lr``).
SECTIONS = {
    "objective": ObjectiveConfig,
    "optim": OptimConfig,
    "loop": LoopConfig,
    "checkpoint": CheckpointConfig,
    "runtime": RuntimeConfig,
}
RENAMED = {f"train.{f.name}": f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in fields(cls)}
RENAMED |= {f"online.{f.name}": f"prepared.{f.name}" for f in fields(PreparedConfig)}  # read by online and served alike


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def warmup_of(total: int, cfg: OptimConfig) -> int:
    """The warmup steps of a run of ``total`` steps: ``warmup_steps``, or ``warmup_fraction`` of the total."""
    if cfg.warmup_fraction:
        return max(1, round(cfg.warmup_fraction * total))
    return cfg.warmup_steps


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warmup, then the decay schedule."""
    warmup = warmup_of(total, cfg)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.schedule == "wsd":  # stable, then a linear decay over the last decay_fraction
        progress = max(0.0, (progress - (1 - cfg.decay_fraction)) / cfg.decay_fraction)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape
