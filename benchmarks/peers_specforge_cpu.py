"""SpecForge 0.2.0's trainer on a CPU machine, to test benchmarks/peers_gpu.sh there (run with
TORCHDYNAMO_DISABLE=1): its loss module imports Triton at module level and its loss is a Triton
kernel, and its FSDP wrapper refuses a module without an accelerator. Triton is stubbed once
transformers and torch.compile's imports are loaded, the loss is the same soft cross-entropy in torch,
and FSDP leaves the module as it is; the rest is SpecForge's own code."""

import contextlib
import sys
import types

import torch
import torch._dynamo.repro.after_dynamo  # noqa: F401
import torch.distributed.fsdp as fsdp
import torch.nn.attention.flex_attention  # noqa: F401
import transformers  # noqa: F401  (these three load before the stub: they look for the real Triton)

torch.compile(lambda x: x)  # (torch.compile's own imports happen here, before the stub replaces Triton)


class _Anything:
    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()


triton = types.ModuleType("triton")
language = types.ModuleType("triton.language")
triton.jit = lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
triton.cdiv = lambda a, b: -(-a // b)
language.__getattr__ = lambda name: _Anything()
triton.language = language
sys.modules["triton"], sys.modules["triton.language"] = triton, language

import specforge.core.loss as loss  # noqa: E402


def _soft_cross_entropy(logits, target_p, position_mask):
    return -torch.sum(position_mask * target_p * torch.log_softmax(logits.float(), dim=-1), -1).mean()


loss.LogSoftmaxLoss.apply = staticmethod(_soft_cross_entropy)


class _NoFSDP:
    def __new__(cls, module, **kwargs):
        return module

    @staticmethod
    def state_dict_type(*args, **kwargs):
        return contextlib.nullcontext()


fsdp.FullyShardedDataParallel = _NoFSDP

from specforge.cli import main  # noqa: E402

raise SystemExit(main(sys.argv[1:]))
