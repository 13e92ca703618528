"""Accelerate and DeepSpeed plumbing of the training loop: the Accelerator of a process, DeepSpeed's batch
geometry, and the ZeRO-3 helpers (whole models during setup, gathered parameters to save, the drafter under
its wrapper, a fresh copy to evaluate). Nothing here is method-specific."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..io import DraftTrainError
from .checkpoint import distributed_kind


def mixed_precision(value: str, device: torch.device) -> str:
    if value == "auto":
        return "bf16" if device.type == "cuda" else "no"
    if value not in ("no", "bf16", "fp16"):
        raise DraftTrainError(f"train.mixed_precision={value}: expected auto, no, bf16 or fp16")
    return value


def make_accelerator(tc, device, log_with):
    """The Accelerator of this process. DeepSpeed on a machine without CUDA (DeepSpeed's CPU accelerator,
    ``DS_ACCELERATOR=cpu``) runs over gloo: accelerate must not get ``cpu=True`` then (that selects its plain
    multi-CPU mode and drops DeepSpeed) and needs the backend named."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    mp = mixed_precision(tc.mixed_precision, device)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return Accelerator(mixed_precision=mp, log_with=log_with, cpu=device.type == "cpu")
    # the launcher exports the config's "auto" accumulation, which Accelerator cannot parse: the loop sets the
    # real value from the batch plan (and writes it into the DeepSpeed config) right after
    kw = dict(mixed_precision=mp, log_with=log_with, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    if device.type == "cpu":
        if torch.cuda.is_available():
            raise DraftTrainError("DeepSpeed with target.device=cpu on a CUDA machine: use target.device=auto")
        kw["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(**kw)


def is_deepspeed(accelerator) -> bool:
    return distributed_kind(accelerator) == "DEEPSPEED"


def configure_deepspeed(accelerator, plan, tc) -> None:
    """DeepSpeed takes the batch geometry and clipping from its config (there is no data loader to infer them
    from, and its engine clips): set them from the plan so they match the non-DeepSpeed runs exactly."""
    if not is_deepspeed(accelerator):
        return
    accelerator.state.deepspeed_plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=plan.micro_batch, gradient_accumulation_steps=plan.accumulation,
        train_batch_size=plan.global_batch, gradient_clipping=float(tc.grad_clip) if tc.grad_clip > 0 else 0.0,
    )


@contextlib.contextmanager
def whole_models(accelerator):
    """While a ZeRO-3 config is active, transformers partitions every model it loads or builds (zero.Init),
    including the frozen target, which no DeepSpeed engine owns; hide that config during setup. The drafter
    is partitioned by ``prepare`` (zero3_init_flag: false)."""
    if not zero3(accelerator):
        yield
        return
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def zero3(accelerator) -> bool:
    if not is_deepspeed(accelerator):
        return False
    return int(accelerator.state.deepspeed_plugin.zero_stage) == 3


def full_params(accelerator, wrapped):
    """ZeRO-3: gather the drafter's full parameters on every process (enter on all of them); else a no-op."""
    if not zero3(accelerator):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(unwrap(accelerator, wrapped).parameters()), modifier_rank=None)


def unwrap(accelerator, wrapped):
    """The drafter under its DDP / FSDP wrapper. ``accelerator.unwrap_model`` imports DeepSpeed whenever it is
    installed (and DeepSpeed's import logs "Setting accelerator to CPU" on a machine without CUDA), so it is
    only used in a DeepSpeed run."""
    if is_deepspeed(accelerator):
        return accelerator.unwrap_model(wrapped)
    from torch.distributed.fsdp import FullyShardedDataParallel  # FSDP1's wrapper (FSDP2 shards in place)

    module = wrapped
    while isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel,
                              FullyShardedDataParallel)):
        module = module.module
    return module


def eval_module(accelerator, wrapped, final_dir: Path):
    """The drafter to evaluate. Under ZeRO-3 the trained module's parameters are partitioned and its forward
    hooks gather them collectively, so the main process evaluates a fresh copy loaded from ``final/``."""
    module = unwrap(accelerator, wrapped)
    if not zero3(accelerator):
        return module
    if not hasattr(type(module), "from_pretrained"):
        raise DraftTrainError(f"ZeRO-3: cannot reload {type(module).__name__} for evaluation; run `drafttrain eval "
                              f"drafter={final_dir}`")
    return type(module).from_pretrained(final_dir, device=accelerator.device)
