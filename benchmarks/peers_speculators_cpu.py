"""speculators 0.9.0's trainer on a CPU machine, to test benchmarks/peers_gpu.sh there: its trainer
moves the model to the local rank as an accelerator index and synchronises the accelerator."""

import sys

import speculators.train.trainer as trainer
import torch
from speculators.train.cli import main
from speculators.train.config import TrainConfig

trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda *a, **k: None
main(TrainConfig.resolve(sys.argv[1:]))
