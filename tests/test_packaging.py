"""A built wheel carries the Hydra configs: installed outside the checkout (``pip install --target``), the CLI
composes ``recipe=eagle3`` and trains from any working directory, with the package imported from the install."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

pytestmark = pytest.mark.slow

CONF = REPO / "drafttrain" / "conf"


def _check(cmd, cwd, env=None, timeout=300):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-5000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the sources, so the build leaves no build/ or egg-info in the checkout."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "drafttrain", src / "drafttrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("whl")
    _check([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
            str(src)], cwd=src)
    (whl,) = out.glob("drafttrain-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    _check([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
            str(wheel)], cwd=target)
    return target


def _env(site: Path) -> dict:
    """Only the install on PYTHONPATH: it comes before site-packages, where the editable install of the checkout
    lives (its finder is appended to sys.meta_path, so the path entry wins; the tests check __file__)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    return env


def test_wheel_holds_every_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.endswith(".yaml")}
    expected = {f"drafttrain/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert expected and shipped == expected
    assert {f"drafttrain/conf/recipe/{m}.yaml" for m in ("eagle3", "medusa", "medusa2", "draft_model")} <= shipped
    assert "drafttrain/conf/accelerate/ddp.yaml" in shipped


def test_installed_cli_composes_recipe_outside_checkout(installed, tmp_path):
    # runpy: the same process prints where drafttrain came from, then runs the module as `python -m drafttrain.cli`
    code = ("import runpy, sys, drafttrain, drafttrain.cli as c; print('FILE', drafttrain.__file__); "
            "print('CONF', c.CONF_DIR); sys.argv = ['drafttrain', 'train', 'recipe=eagle3', '--cfg', 'job']; "
            "runpy.run_module('drafttrain.cli', run_name='__main__')")
    r = _check([sys.executable, "-s", "-c", code], cwd=tmp_path, env=_env(installed))
    lines = r.stdout.splitlines()
    file_ = Path(next(ln for ln in lines if ln.startswith("FILE ")).split(" ", 1)[1]).resolve()
    conf = Path(next(ln for ln in lines if ln.startswith("CONF ")).split(" ", 1)[1])
    assert file_ == (installed / "drafttrain" / "__init__.py").resolve(), r.stdout
    assert REPO not in file_.parents
    assert conf == (installed / "drafttrain" / "conf").resolve()
    assert "method: eagle3" in lines, r.stdout[-3000:]
    assert "eagle3:" in lines  # the recipe's method section is in the composed job config

    # the console script pip wrote into the install runs the same command
    script = installed / "bin" / "drafttrain"
    r = _check([sys.executable, "-s", str(script), "train", "recipe=medusa", "--cfg", "job"], cwd=tmp_path,
               env=_env(installed))
    assert "method: medusa" in r.stdout.splitlines(), r.stdout[-3000:]


def test_installed_cli_trains_outside_checkout(installed, tiny_builtin_target, tmp_path):
    """`drafttrain train recipe=eagle3 train.max_steps=2` from the wheel install, on the tiny built-in target
    (DRAFTTRAIN_CACHE from the cache_dir fixture is inherited), fixed data without regeneration, no eval."""
    run = tmp_path / "run"
    work = tmp_path / "elsewhere"
    work.mkdir()
    cmd = [sys.executable, "-s", str(installed / "bin" / "drafttrain"), "train", "recipe=eagle3",
           "train.max_steps=2", *TINY_BUILTIN_OVERRIDES, "logger=none", "data.regenerate=false",
           "data.num_train=8", "data.num_eval=2", "data.max_length=128", "train.batch_size=2",
           "train.micro_batch_size=2", "train.warmup_steps=1", "train.eval=false", "eagle3.ttt_steps=2",
           f"hydra.run.dir={run}"]
    _check(cmd, cwd=work, env=_env(installed), timeout=600)
    assert (run / "final" / "config.json").exists()
    assert (run / ".hydra" / "config.yaml").exists()
