"""Shared fixtures. Everything runs offline on CPU with tiny models built in the tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent

# A tiny built-in target (same code path as the real one, a few training steps on a few files).
TINY_BUILTIN = {"steps": 10, "max_files": 20}
TINY_BUILTIN_OVERRIDES = [f"target.builtin.{k}={v}" for k, v in TINY_BUILTIN.items()]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("drafttrain-cache")
    os.environ["DRAFTTRAIN_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_builtin_target(cache_dir) -> Path:
    from drafttrain.targets.builtin import BuiltinSpec, ensure_builtin_target

    return ensure_builtin_target(BuiltinSpec(**TINY_BUILTIN), quiet=True)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests: on a few shared cores a thread pool only adds
    overhead and contention (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
