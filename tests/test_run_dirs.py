"""Run directories are never reused by accident (drafttrain/rundir.py, cli._settle_run_dir): a folder that
holds a run is refused in one line unless the job resumes it or asks to move it aside; default run directories
are unique even for launches in the same second."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from drafttrain.io import DraftTrainError
from drafttrain.rundir import claim_new_dir, guard_run_dir, run_results

from .conftest import REPO, TINY_BUILTIN_OVERRIDES


def _cli(args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "drafttrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env or dict(os.environ))


def _one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return err[0]


def _fake_run(d: Path, kind: str = "train") -> dict[Path, str]:
    files = {"train": {"final/model.safetensors": "weights", "train_metrics.json": "{}"},
             "eval": {"report.json": "{}"}, "bench": {"bench.json": "{}"}, "tune": {"tune.json": "{}"}}[kind]
    out = {}
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        out[p] = text
    return out


def _untouched(files: dict[Path, str]) -> bool:
    return all(p.read_text() == t for p, t in files.items())


# ---------------------------------------------------------------- the rule, as library calls
def test_what_holds_a_run(tmp_path):
    assert run_results("train", tmp_path) == []
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "checkpoints").mkdir()  # empty: a run that stopped before its first checkpoint left nothing
    assert run_results("train", tmp_path) == []
    (tmp_path / "checkpoints" / "step_00000001").mkdir()
    assert run_results("train", tmp_path) == ["checkpoints/"]
    assert run_results("eval", tmp_path) == []
    (tmp_path / "report.json").write_text("{}")
    assert run_results("eval", tmp_path) == ["report.json"]


def test_guard_refuses_resumes_and_moves_aside(tmp_path):
    run = tmp_path / "run"
    files = _fake_run(run)
    with pytest.raises(DraftTrainError, match=r"holds an earlier train run \(final/, train_metrics.json\).*"
                                              r"train.resume=auto.*train.overwrite=true"):
        guard_run_dir("train", run)
    assert _untouched(files)
    assert guard_run_dir("train", run, resume="auto") is None and _untouched(files)
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    assert guard_run_dir("train", run, resume=str(run / "checkpoints" / "step_00000002")) is None
    other = tmp_path / "other" / "checkpoints" / "step_00000002"  # another run's checkpoint would mix two runs
    with pytest.raises(DraftTrainError, match="holds an earlier train run"):
        guard_run_dir("train", run, resume=str(other))
    assert guard_run_dir("train", run, overwrite=True, main=False, wait_s=0.3) is None  # only rank 0 moves it
    assert _untouched(files)
    said = []
    aside = guard_run_dir("train", run, overwrite=True, say=said.append)
    assert aside.name.startswith("run.old-") and not run.exists()
    assert (aside / "final" / "model.safetensors").read_text() == "weights"
    assert str(aside) in said[0] and "nothing deleted" in said[0]
    _fake_run(run)
    again = guard_run_dir("train", run, overwrite=True, say=said.append)
    assert again != aside and aside.exists() and again.exists()


def _claim(base):
    return str(claim_new_dir(base))


def test_default_run_directories_are_unique_for_launches_in_the_same_second(tmp_path):
    base = tmp_path / "runs" / "eagle3-20261207-101010"
    with ProcessPoolExecutor(4) as pool:
        got = list(pool.map(_claim, [base] * 8))
    assert len(set(got)) == 8 and str(base) in got and str(base) + "-2" in got
    assert all(Path(g).is_dir() for g in got)


# ---------------------------------------------------------------- through the commands (before anything loads)
@pytest.mark.parametrize("kind,args", [("train", ["logger=none"]), ("eval", ["decode.method=ar"]),
                                       ("bench", []), ("tune", ["decode.method=pld"])])
def test_every_run_command_refuses_a_folder_holding_its_results(tmp_path, kind, args):
    run = tmp_path / "run"
    files = _fake_run(run, kind)
    r = _cli([kind, *args, f"hydra.run.dir={run}"], cwd=tmp_path)
    line = _one_error_line(r)
    key = "train.overwrite" if kind == "train" else "overwrite"
    assert str(run) in line and f"earlier {kind} run" in line and f"{key}=true" in line
    assert _untouched(files) and sorted(p.name for p in run.iterdir()) == sorted({p.relative_to(run).parts[0]
                                                                                 for p in files})


def test_overwrite_and_resume_together_are_refused(tmp_path):
    line = _one_error_line(_cli(["train", "train.overwrite=true", "train.resume=auto", "logger=none"], cwd=tmp_path))
    assert "train.overwrite=true with train.resume=auto" in line
    assert not (tmp_path / "runs").exists()


def test_overwrite_moves_the_earlier_run_aside_before_hydra_writes(tmp_path):
    run = tmp_path / "run"
    files = _fake_run(run)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("the earlier run's config\n")
    (tmp_path / "notamodel").mkdir()  # the job fails right after Hydra made the folder
    r = _cli(["train", "logger=none", "train.overwrite=true", "target=./notamodel", f"hydra.run.dir={run}"],
             cwd=tmp_path)
    assert r.returncode == 2 and "moved the earlier run in" in r.stdout
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / ".hydra" / "config.yaml").read_text() == "the earlier run's config\n"
    assert _untouched({aside[0] / p.relative_to(run): t for p, t in files.items()})
    assert not (run / "final").exists() and (run / ".hydra" / "config.yaml").exists()  # the new run's own


def test_two_launches_at_once_get_their_own_default_directories(tmp_path):
    (tmp_path / "notamodel").mkdir()
    cmd = [sys.executable, "-m", "drafttrain.cli", "train", "logger=none", "target=./notamodel"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    dirs = [ln.split("run directory: ")[1] for out, _ in outs for ln in out.splitlines() if "run directory: " in ln]
    assert len(dirs) == 2 and dirs[0] != dirs[1], outs
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(Path(d).name for d in dirs)


# ---------------------------------------------------------------- a real second run into the same folder
RUN = [*TINY_BUILTIN_OVERRIDES, "data.num_train=16", "data.regen_max_new_tokens=24", "data.num_eval=2",
       "data.max_length=128", "train.batch_size=4", "train.micro_batch_size=2", "train.max_steps=2",
       "train.warmup_steps=1", "eagle3.ttt_steps=1", "train.eval=false", "logger=none"]


@pytest.mark.slow
def test_a_second_training_into_the_same_folder_never_replaces_the_first(tmp_path, tiny_builtin_target):
    run = tmp_path / "run"

    def train(*extra):
        return subprocess.run([sys.executable, str(REPO / "train.py"), "recipe=eagle3", *RUN, *extra,
                               f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=600, cwd=REPO,
                              env=dict(os.environ))

    r = train()
    assert r.returncode == 0, r.stderr[-3000:]
    first = load_file(run / "final" / "model.safetensors")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*") if ".hydra" not in p.parts)
    line = _one_error_line(train("train.seed=1"))
    assert "holds an earlier train run" in line
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if ".hydra" not in p.parts) == before
    r = train("train.seed=1", "train.overwrite=true")
    assert r.returncode == 0, r.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1
    kept = load_file(aside[0] / "final" / "model.safetensors")
    assert all(kept[k].equal(first[k]) for k in first)
    second = load_file(run / "final" / "model.safetensors")
    assert any(not second[k].equal(first[k]) for k in first if second[k].is_floating_point())
