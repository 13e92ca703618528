"""Reliability: bad input gets one clear error and leaves the input untouched; interruptions lose nothing;
nothing is unpickled from user paths. (More cases live beside their code: test_data_chat.py for JSONL and
conversation errors, test_targets.py for target paths and taps, test_config.py for config keys/types.)"""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafttrain.io import DraftTrainError, atomic_dir, atomic_path, write_json
from drafttrain.training import checkpoint

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

RUN = [
    *TINY_BUILTIN_OVERRIDES,
    "data.num_train=48", "data.regen_max_new_tokens=48", "data.num_eval=2", "data.max_length=160",
    "train.batch_size=4", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=2",
    "eagle3.ttt_steps=2", "train.eval=false", "logger=none",
]


def _train(args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "train.py"), "recipe=eagle3", *RUN, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=dict(os.environ))


def _one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return err[0]


# ---------------------------------------------------------------- bad input through the real entry point
@pytest.mark.slow
def test_malformed_jsonl_names_file_and_line_and_is_untouched(tmp_path, tiny_builtin_target):
    data = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    text = good + "\n" + good + "\n{not json\n"
    data.write_text(text)
    r = _train([f"data={data}", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    line = _one_error_line(r)
    assert f"{data}:3" in line
    assert data.read_text() == text
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
def test_zero_trainable_tokens_is_an_error(tmp_path, tiny_builtin_target):
    data = tmp_path / "empty.jsonl"
    row = {"messages": [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    r = _train([f"data={data}", "data.max_length=32", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    line = _one_error_line(r)
    assert "trainable" in line and str(data) in line and "longer than data.max_length=32" in line


@pytest.mark.slow
def test_draft_vocab_larger_than_target_vocab(tmp_path, tiny_builtin_target):
    r = _train(["eagle3.draft_vocab_size=999999", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "draft_vocab_size=999999" in _one_error_line(r)


@pytest.mark.slow
def test_offline_capture_refused_for_medusa2_before_anything_loads(tmp_path, tiny_builtin_target):
    feats = tmp_path / "feats"
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "recipe=medusa2", *RUN, "capture.mode=offline",
                        f"capture.path={feats}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ))
    line = _one_error_line(r)
    assert "method=medusa2 cannot train from stored features" in line and "capture.mode=online" in line
    assert "target:" not in r.stdout and not feats.exists()  # refused before the target was loaded


@pytest.mark.slow
def test_tap_layer_out_of_range(tmp_path, tiny_builtin_target):
    r = _train(["eagle3.tap_layers=[2,4,42]", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "42" in _one_error_line(r) and "out of range" in _one_error_line(r)


@pytest.mark.slow
def test_missing_target_path(tmp_path):
    r = _train([f"target={tmp_path / 'nope'}", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "no such directory" in _one_error_line(r)


# ---------------------------------------------------------------- checkpoints: compatibility, NaN, kill -9
def test_resume_refuses_another_method_or_target(tmp_path):
    meta = {"method": "eagle3", "target": "/models/a"}
    with pytest.raises(DraftTrainError, match="method='medusa'"):
        checkpoint.check_compatible({"method": "medusa", "target": "/models/a"}, meta, tmp_path)
    with pytest.raises(DraftTrainError, match="target='/models/b'"):
        checkpoint.check_compatible({"method": "eagle3", "target": "/models/b"}, meta, tmp_path)
    with pytest.raises(DraftTrainError, match="not a checkpoint directory"):
        checkpoint.resolve_resume(str(tmp_path), tmp_path / "run")


@pytest.mark.slow
def test_non_finite_loss_stops_with_step_and_batch_and_keeps_last_good_checkpoint(tmp_path, tiny_builtin_target):
    run = tmp_path / "run"
    r = _train(["train.lr=1e12", "train.warmup_steps=0", "train.grad_clip=0", "train.max_steps=8",
                "train.save_every=1", "train.keep_checkpoints=8", f"hydra.run.dir={run}"])
    line = _one_error_line(r)
    assert "non-finite" in line and "at step" in line and "dataset rows [" in line
    assert not (run / "final").exists()
    ckpts = checkpoint.list_checkpoints(run)
    for c in ckpts:  # every checkpoint left on disk holds finite weights
        w = load_file(c / "drafter.safetensors")
        assert all(torch.isfinite(v).all() for v in w.values() if v.is_floating_point()), c
    if ckpts:
        assert str(ckpts[-1]) in line


@pytest.mark.slow
def test_kill_9_during_training_then_resume_is_identical(tmp_path, tiny_builtin_target):
    common = ["train.max_steps=8", "train.save_every=1", "train.keep_checkpoints=2"]
    ref = tmp_path / "ref"
    r = _train([*common, f"hydra.run.dir={ref}"])
    assert r.returncode == 0, r.stderr[-3000:]

    run = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "train.py"), "recipe=eagle3", *RUN, *common, f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (run / "checkpoints" / "step_00000003").exists():
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()
    for p in (run / "checkpoints").iterdir():  # no half-written checkpoint under a final name
        assert not p.name.startswith("step_") or (p / "state.json").exists()

    r = _train([*common, "train.resume=auto", f"hydra.run.dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_that_builds_the_target_trains_what_a_cached_run_trains(tmp_path, tiny_builtin_target):
    """The first run on a machine builds the built-in target (and regenerates the data) inside the job; it must
    train the same drafter as every later run, which finds both cached (or resuming its checkpoints would not
    continue it)."""
    env = {**os.environ, "DRAFTTRAIN_CACHE": str(tmp_path / "cache")}  # empty: the first run builds a target
    args = [*(o for o in RUN if not o.startswith("target.builtin.")), "target.builtin.steps=3",
            "target.builtin.max_files=20", "train.max_steps=2"]
    finals = []
    for name in ("builds", "cached"):
        r = subprocess.run([sys.executable, str(REPO / "train.py"), "recipe=eagle3", *args,
                            f"hydra.run.dir={tmp_path / name}"], capture_output=True, text=True, timeout=300,
                           cwd=REPO, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("building the built-in target" in r.stdout + r.stderr) == (name == "builds")
        finals.append(load_file(tmp_path / name / "final" / "model.safetensors"))
    a, b = finals
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- atomic writes
def test_atomic_file_write_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "report.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text('{"v": 2, "half')
            raise RuntimeError("crash mid-write")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_atomic_dir_keeps_old_directory_on_crash(tmp_path):
    d = tmp_path / "final"
    with atomic_dir(d) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(d) as tmp:
            (tmp / "a.txt").write_text("new, half")
            raise RuntimeError("crash")
    assert (d / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    with pytest.raises(DraftTrainError, match="refusing to overwrite"):
        with atomic_dir(d, overwrite=False):
            pass


# ---------------------------------------------------------------- untrusted files
def _calls(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            full = f"{getattr(f.value, 'id', '')}.{f.attr}" if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if full == name:
                yield node


def test_no_pickle_loading_and_no_default_remote_code():
    offenders = []
    for path in sorted((REPO / "drafttrain").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "torch.load"):
            kw = {k.arg: k.value for k in call.keywords}
            ok = "weights_only" in kw and isinstance(kw["weights_only"], ast.Constant) and kw["weights_only"].value
            if not ok:
                offenders.append(f"{path.relative_to(REPO)}:{call.lineno} torch.load without weights_only=True")
        for name in ("pickle.load", "pickle.loads", "dill.load"):
            offenders += [f"{path.relative_to(REPO)}:{c.lineno} {name}" for c in _calls(tree, name)]
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if isinstance(node.value, ast.Constant) and node.value.value is True:
                    offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno} trust_remote_code=True")
    assert not offenders, offenders
    from drafttrain.config import TargetConfig

    assert TargetConfig().trust_remote_code is False


def test_checkpoint_optimizer_state_loads_with_weights_only(tmp_path):
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save_checkpoint(tmp_path / "c", m, opt, sched, 1, {"method": "x", "target": "y"})
    state = torch.load(tmp_path / "c" / "optimizer.pt", weights_only=True)
    assert "state" in state and "param_groups" in state
    assert Path(tmp_path / "c" / "state.json").exists()


@pytest.mark.slow
def test_eval_refuses_a_drafter_trained_for_another_target(tmp_path, tiny_builtin_target):
    fake = tmp_path / "drafter"
    fake.mkdir()
    write_json(fake / "config.json", {"drafter_type": "eagle3", "target_name_or_path": "/models/another-target"})
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "eval", f"drafter={fake}",
                        f"target={tiny_builtin_target}", f"hydra.run.dir={tmp_path / 'ev'}"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ))
    line = _one_error_line(r)
    assert "/models/another-target" in line and "was trained for target" in line


@pytest.mark.slow
def test_kill_9_during_capture_then_rerun_equals_uninterrupted(tmp_path, tiny_builtin_target):
    from drafttrain.capture.store import FeatureStore

    args = [*TINY_BUILTIN_OVERRIDES, "data.num_train=48", "data.regen_max_new_tokens=48", "data.num_eval=3",
            "data.max_length=160", "capture.dtype=float32", "capture.shard_mb=1"]

    def capture(path, popen=False):
        cmd = [sys.executable, "-m", "drafttrain.cli", "capture", *args, f"capture.path={path}"]
        if popen:
            return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ))
        assert r.returncode == 0, r.stderr[-3000:]

    capture(tmp_path / "ref")
    killed = tmp_path / "killed"
    proc = capture(killed, popen=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not list(killed.glob("shard-*.safetensors")):
        time.sleep(0.01)
    assert proc.poll() is None, "capture finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    capture(killed)  # rerun: resumes, never reuses a partial shard
    a, b = FeatureStore(tmp_path / "ref", verify="full"), FeatureStore(killed, verify="full")
    assert [r["sha256"] for r in a.records] == [r["sha256"] for r in b.records]
    assert sorted(p.name for p in killed.glob("shard-*")) == sorted(p.name for p in (tmp_path / "ref").glob("shard-*"))
