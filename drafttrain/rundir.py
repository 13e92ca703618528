"""Run directories: a folder that holds a run is never reused by accident.

``train``, ``eval``, ``bench`` and ``tune`` write into a run directory (``hydra.run.dir``). One that already
holds that command's results (``RESULTS``) is refused in one line, unless the job resumes it
(``train.resume=auto`` or a checkpoint inside it) or asks for ``overwrite`` (``train.overwrite=true``;
``overwrite=true`` for eval / bench / tune): then the earlier run is moved aside, whole, to
``<dir>.old-<timestamp>`` before anything is written, so the two runs are never mixed. A default run directory
(``runs/<method>-<time>``) is claimed with an exclusive ``mkdir``: two launches in the same second get
``…-<time>`` and ``…-<time>-2``. Under ``accelerate launch`` every process claims one and the training loop
makes them all use rank 0's (training/loop.py ``_start``). Used by the CLI before Hydra creates the folder.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .io import DraftTrainError

__all__ = ["RESULTS", "run_results", "claim_new_dir", "move_aside", "guard_run_dir"]

# what marks a folder as holding a command's results (a directory counts when it is not empty)
RESULTS = {
    "train": ("final", "checkpoints", "train_metrics.json", "report.json"),
    "eval": ("report.json",),
    "bench": ("bench.json", "bench.md"),
    "tune": ("tune.json",),
}
# the key that asks to move an earlier run aside, per command
OVERWRITE_KEY = {"train": "train.overwrite", "eval": "overwrite", "bench": "overwrite", "tune": "overwrite"}


def run_results(kind: str, run_dir: str | os.PathLike) -> list[str]:
    """The entries of ``run_dir`` that hold results of command ``kind`` (empty: it holds no such run)."""
    d = Path(run_dir)
    found = []
    for name in RESULTS[kind]:
        p = d / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def claim_new_dir(base: str | os.PathLike) -> Path:
    """Create and return a new directory ``base``, or ``base-2``, ``base-3``, … if it exists (exclusive mkdir:
    two processes never get the same one)."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        d = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise DraftTrainError(f"{base}: 10000 run directories of that name exist; set hydra.run.dir=<dir>")


def move_aside(run_dir: str | os.PathLike) -> Path:
    """Rename ``run_dir`` to ``<run_dir>.old-<timestamp>`` (``-2``, … if taken) and return the new name."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}" + ("" if n == 1 else f"-{n}"))
        if aside.exists():
            continue
        try:
            os.rename(run_dir, aside)  # refuses an existing non-empty target; same filesystem, so atomic
            return aside
        except OSError:
            if aside.exists():
                continue
            raise
    raise DraftTrainError(f"{run_dir}: cannot find a free name to move it aside")


def _resumes_it(resume: str | None, run_dir: Path) -> bool:
    if not resume:
        return False
    if resume == "auto":
        return True
    ckpt = Path(os.path.expanduser(resume)).resolve()
    return ckpt == run_dir.resolve() or run_dir.resolve() in ckpt.parents


def guard_run_dir(kind: str, run_dir: str | os.PathLike, *, resume: str | None = None, overwrite: bool = False,
                  main: bool = True, say=print, wait_s: float = 600.0) -> Path | None:
    """Check that ``run_dir`` may receive a new run of ``kind``; returns where an earlier run was moved (or None).

    Refused (DraftTrainError, one line) when it holds results of ``kind``, unless ``resume`` resumes it or
    ``overwrite`` is set: then the main process moves it aside and the other processes of a launch wait until
    it is gone (they never move it themselves)."""
    run_dir = Path(run_dir)
    found = run_results(kind, run_dir)
    if not found or _resumes_it(resume, run_dir):
        return None
    key = OVERWRITE_KEY[kind]
    if not overwrite:
        resume_hint = "resume it with train.resume=auto, " if kind == "train" else ""
        raise DraftTrainError(
            f"{run_dir}: holds an earlier {kind} run ({', '.join(found)}); {resume_hint}set {key}=true to move it "
            f"aside to {run_dir.name}.old-<time>, or choose another hydra.run.dir")
    if not main:
        deadline = time.time() + wait_s
        while run_results(kind, run_dir) and time.time() < deadline:
            time.sleep(0.2)
        return None
    aside = move_aside(run_dir)
    say(f"[drafttrain] {key}=true: moved the earlier run in {run_dir} aside to {aside} (nothing deleted)")
    return aside
