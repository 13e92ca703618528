"""Process-level settings applied before any job runs."""
from __future__ import annotations

import os


def cpu_threads_for_this_process(env: dict | None = None, cores: int | None = None) -> int | None:
    """How many intra-op threads torch should use here, or None to leave torch's own choice.

    ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` unless told otherwise (``--cpu`` aside), which on a
    CPU-only machine makes a single-process run use one core of several. Under a launcher (accelerate or
    torchrun, i.e. ``LOCAL_WORLD_SIZE`` set) with that value, each process gets its share of the usable cores
    instead. ``DRAFTTRAIN_THREADS=N`` pins the count; a launcher value other than 1 is respected.
    """
    env = os.environ if env is None else env
    if env.get("DRAFTTRAIN_THREADS"):
        return max(1, int(env["DRAFTTRAIN_THREADS"]))
    launched = "LOCAL_WORLD_SIZE" in env or any(k.startswith("ACCELERATE_") for k in env)
    if not launched or env.get("OMP_NUM_THREADS") != "1":
        return None
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    share = cores // local
    return share if share > 1 else None


def configure_cpu_threads() -> None:
    """Apply :func:`cpu_threads_for_this_process` when the job runs on CPU (GPU jobs keep torch's default)."""
    import torch

    n = cpu_threads_for_this_process()
    if n is not None and not torch.cuda.is_available() and n != torch.get_num_threads():
        torch.set_num_threads(n)


def quiet_deepspeed_on_cpu(env: dict | None = None, cuda: bool | None = None) -> None:
    """On a machine without CUDA, name DeepSpeed's accelerator (``DS_ACCELERATOR=cpu``, what it falls back to
    anyway). Libraries import DeepSpeed whenever it is installed (transformers' ``save_pretrained`` through
    accelerate's ``extract_model_from_parallel``), and its fallback prints "Setting accelerator to CPU …" in
    runs that never use it. A value the user set is kept."""
    env = os.environ if env is None else env
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
