"""ModelOpt's example launcher (main.py, run from its directory) on a CPU machine with Python 3.11, to
test benchmarks/peers_gpu.sh there: 3.11's make_dataclass files HfTrainingArguments under the module
``types``, which its checkpoint pickling cannot find (3.12, the GPU machine's, uses the caller's)."""

import main  # ModelOpt's examples/speculative_decoding/main.py (on PYTHONPATH)

main.HfTrainingArguments.__module__ = "main"
main.train()
