"""Caches are keyed by what the target is, not by the path it was reached through (identity.py):
the same cache reached through a symlink or moved elsewhere is reused; another target is told apart."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from drafttrain.io import DraftTrainError
from drafttrain.identity import same_target, target_identity

from .conftest import TINY_BUILTIN


def _job(**data):
    from drafttrain.config import BuiltinTargetConfig, TrainJob

    job = TrainJob()
    job.target.builtin = BuiltinTargetConfig(**TINY_BUILTIN)
    for k, v in {"num_train": 4, "num_eval": 1, "regen_max_new_tokens": 8, "max_length": 96, **data}.items():
        setattr(job.data, k, v)
    return job


def _training_rows(job, monkeypatch, cache: Path, with_model: bool = True):
    """What a training job reads with DRAFTTRAIN_CACHE=cache (the target and the regenerated data inside it);
    ``with_model=False``: the cache must hold everything (no target to regenerate with)."""
    from drafttrain.data.select import load_training_data
    from drafttrain.targets.load import load_target, target_id

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(cache))
    model, tokenizer, path = load_target(job.target)
    examples, _, _ = load_training_data(job, model if with_model else None, tokenizer, target_id(path), cache)
    return [ex["input_ids"] for ex in examples]


def _seed_cache(tiny_builtin_target: Path, cache: Path) -> None:
    cache.mkdir()
    shutil.copytree(tiny_builtin_target, cache / tiny_builtin_target.name)


@pytest.mark.slow
def test_a_cache_reached_through_a_symlink_is_reused(tmp_path, tiny_builtin_target, monkeypatch):
    cache = tmp_path / "cache"
    _seed_cache(tiny_builtin_target, cache)
    job = _job()
    rows = _training_rows(job, monkeypatch, cache)
    link = tmp_path / "link"
    link.symlink_to(cache)
    assert _training_rows(job, monkeypatch, link) == rows  # was: the existing output was generated with other settings
    assert len(list((cache / "data").glob("builtin-regen-*.jsonl"))) == len(list((cache / "data").glob("*.jsonl")))


@pytest.mark.slow
def test_a_moved_cache_is_reused_without_regenerating(tmp_path, tiny_builtin_target, monkeypatch):
    cache = tmp_path / "cache"
    _seed_cache(tiny_builtin_target, cache)
    job = _job()
    rows = _training_rows(job, monkeypatch, cache)
    files = sorted(p.name for p in (cache / "data").iterdir())
    moved = tmp_path / "elsewhere" / "cache"
    moved.parent.mkdir()
    shutil.move(str(cache), str(moved))
    assert _training_rows(job, monkeypatch, moved, with_model=False) == rows  # found, nothing regenerated
    assert sorted(p.name for p in (moved / "data").iterdir()) == files


@pytest.mark.slow
def test_another_setting_or_target_gets_its_own_entry(tmp_path, tiny_builtin_target, monkeypatch):
    cache = tmp_path / "cache"
    _seed_cache(tiny_builtin_target, cache)
    _training_rows(_job(), monkeypatch, cache)
    n = len(list((cache / "data").glob("*.jsonl")))
    with pytest.raises(DraftTrainError, match="no target model was given"):  # a new setting is a new entry
        _training_rows(_job(regen_max_new_tokens=9), monkeypatch, cache, with_model=False)
    assert len(list((cache / "data").glob("*.jsonl"))) > n


def _fake_target(d: Path, weights: bytes, config: dict | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 8}))
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_identity_follows_content_not_path(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    a = _fake_target(tmp_path / "a", b"w" * 1000)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    link = tmp_path / "link"
    link.symlink_to(a)
    ident = target_identity(a)
    assert ident.startswith("sha256:") and target_identity(copy) == ident == target_identity(link)
    assert target_identity(str(a) + "/") == ident and same_target(str(a), str(link))
    other = _fake_target(tmp_path / "b", b"w" * 999 + b"x")  # same size, other weights
    assert target_identity(other) != ident and not same_target(str(a), str(other))
    cfg = _fake_target(tmp_path / "c", b"w" * 1000, {"model_type": "llama", "hidden_size": 16})
    assert target_identity(cfg) != ident
    assert target_identity("org/name") == "org/name" and target_identity(ident) == ident


def test_identity_hashes_weights_once_and_notices_a_change(tmp_path, monkeypatch):
    import drafttrain.identity as I

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    a = _fake_target(tmp_path / "a", b"w" * 1000)
    first = target_identity(a)
    reads = []
    real_open = open
    monkeypatch.setattr(I, "open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k), raising=False)
    assert target_identity(a) == first and reads == []  # the recorded hash, not a second read
    (a / "model.safetensors").write_bytes(b"v" * 1000)
    os.utime(a / "model.safetensors", ns=(1, 1))
    assert target_identity(a) != first and reads


def test_a_hub_cache_blob_name_is_its_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    digest = "ab" * 32
    (blobs / digest).write_bytes(b"weights")
    snap = tmp_path / "hub" / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").symlink_to(blobs / digest)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    (copy / "model.safetensors").write_bytes(b"weights")
    assert target_identity(snap) != target_identity(copy)  # the blob's name is taken as its sha256 (not re-read)
    (blobs / digest).rename(blobs / __import__("hashlib").sha256(b"weights").hexdigest())
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(blobs / __import__("hashlib").sha256(b"weights").hexdigest())
    assert target_identity(snap) == target_identity(copy)


def test_builtin_identity_is_its_cache_entry_name(tiny_builtin_target, tmp_path):
    assert target_identity(tiny_builtin_target) == tiny_builtin_target.name
    copy = tmp_path / "renamed"
    shutil.copytree(tiny_builtin_target, copy)
    assert target_identity(copy) == tiny_builtin_target.name
    assert torch is not None


def test_records_made_through_another_path_still_match(tmp_path, monkeypatch):
    """Regenerate outputs, feature stores and checkpoints recorded the target's path (older records) or its
    identity: either matches the same target through another path, and never another target."""
    from drafttrain.capture.capture import _check_same_plan
    from drafttrain.data.regenerate import _check_meta
    from drafttrain.training.checkpoint import check_compatible

    monkeypatch.setenv("DRAFTTRAIN_CACHE", str(tmp_path / "cache"))
    a = _fake_target(tmp_path / "a", b"w" * 100)
    link = tmp_path / "link"
    link.symlink_to(a)
    other = _fake_target(tmp_path / "b", b"v" * 100)
    meta = tmp_path / "out.jsonl.meta.json"
    for recorded in (str(a), target_identity(a)):  # an older record (a path) and today's (the identity)
        meta.write_text(json.dumps({"backend": "hf", "model": recorded, "max_new_tokens": 8}))
        _check_meta(meta, {"backend": "hf", "model": target_identity(link), "max_new_tokens": 8}, has_rows=True)
        with pytest.raises(DraftTrainError, match="generated with other settings"):
            _check_meta(meta, {"backend": "hf", "model": target_identity(other), "max_new_tokens": 8}, True)
    plan = {"method": "eagle3", "target": str(a), "target_id": target_identity(a)}
    _check_same_plan({"method": "eagle3", "target": str(a)}, {**plan, "target": str(link)}, tmp_path)
    _check_same_plan(plan, {**plan, "target": str(link)}, tmp_path)
    with pytest.raises(DraftTrainError, match="different target, target_id"):
        _check_same_plan(plan, {**plan, "target": str(other), "target_id": target_identity(other)}, tmp_path)
    check_compatible({"method": "eagle3", "target": str(a)}, {"method": "eagle3", "target": str(link)}, tmp_path)
    with pytest.raises(DraftTrainError, match="checkpoint was made for target"):
        check_compatible({"method": "eagle3", "target": str(a)}, {"method": "eagle3", "target": str(other)}, tmp_path)


# ---------------------------------------------------------------- concurrent jobs sharing one cache
@pytest.mark.slow
def test_two_trainings_started_together_on_an_empty_cache_build_once_and_agree(tmp_path):
    """Both jobs need the built-in target and its regenerated data: one builds each (file locks), the other
    waits and reads the finished artefact (written under a temporary name and renamed, or appended under the
    lock), and both train the same drafter."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from .conftest import REPO

    env = {**os.environ, "DRAFTTRAIN_CACHE": str(tmp_path / "cache")}
    args = ["recipe=eagle3", "target.builtin.steps=3", "target.builtin.max_files=20", "data.num_train=16",
            "data.regen_max_new_tokens=24", "data.num_eval=2", "data.max_length=128", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=1", "eagle3.ttt_steps=1",
            "train.eval=false", "logger=none"]
    procs = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={tmp_path / n}"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in ("a", "b")]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    assert sum("building the built-in target" in o for o in outs) == 1, outs
    assert sum("built-in data" in o and "regenerated" in o for o in outs) >= 1
    assert len(list((tmp_path / "cache").glob("builtin-target-*"))) == 1
    assert not list((tmp_path / "cache").glob(".builtin-target-*.tmp"))  # no half-built target left behind
    a, b = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
