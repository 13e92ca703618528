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


# The fast tier (`pytest -m "not slow"`, README) also leaves out, without a mark in their files, the tests of
# these modules and every test that needs these fixtures:
SLOW_MODULES = {"test_builtin_docs.py"}  # builds the second built-in target and trains every family on it
SLOW_FIXTURES = {"tiny_builtin_target"}  # built once per session: ~30-50 s on 2 cores before the first such test


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    engine_selected = "engine" in (config.getoption("markexpr") or "")
    for item in items:
        if item.path.name in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if not engine_selected and item.get_closest_marker("engine"):  # the engine tier runs on its own
            item.add_marker(pytest.mark.skip(reason="engine tier: run with -m engine (after scripts/make_engine_venv.sh)"))


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
