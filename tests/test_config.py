"""Every shipped config composes into the structured schema; bad keys and values fail in one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import drafttrain.config as C
from drafttrain.cli import CONF_DIR, _without_hydra_flags, expand_shorthands
from drafttrain.validate import check_values

from .conftest import REPO

PRIMARY = {"train": C.TrainJob, "eval": C.EvalJob, "build_target": C.BuildTargetJob,
           "regenerate": C.RegenerateJob, "bench": C.BenchJob, "tune": C.TuneJob, "capture": C.CaptureJob,
           "export": C.ExportJob}
REQUIRED = {"regenerate": ["input=a.jsonl", "output=b.jsonl"], "capture": ["capture.path=feats"],
            "export": ["drafter=runs/r/final", "format=vllm", "out=exported"]}
GROUP_REQUIRED = {("target", "hf"): ["target.name_or_path=some/dir"], ("data", "jsonl"): ["data.path=x.jsonl"],
                  ("data", "hub"): ["data.path=org/chats"], ("data", "file"): ["data.path=chats.parquet"]}


def _compose(name, overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_recipe_dir_is_the_recipe_group():
    # the configs live in the package (a wheel carries them); no symlink inside it, since wheels drop symlinks
    assert CONF_DIR == REPO / "drafttrain" / "conf"
    assert not (CONF_DIR / "recipe").is_symlink() and (CONF_DIR / "recipe").is_dir()
    # the checkout's top-level conf/ and recipes/ are links into it (README's conf/accelerate/... paths)
    assert (REPO / "recipes").resolve() == (CONF_DIR / "recipe").resolve()
    assert (REPO / "conf").resolve() == CONF_DIR.resolve()
    assert _options("recipe"), "no recipes found"


@pytest.mark.parametrize("name", sorted(PRIMARY))
def test_primary_configs_compose(name):
    cfg = _compose(name, REQUIRED.get(name, []))
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, PRIMARY[name])
    check_values(name, cfg)  # every shipped default is inside its declared range


def _group_cases():
    cases = []
    for group in ("target", "data", "logger", "recipe"):
        for opt in _options(group):
            for primary in ("train", "eval"):
                if group == "recipe" and primary != "train":
                    continue
                cases.append((primary, group, opt))
    return cases


@pytest.mark.parametrize("primary,group,opt", _group_cases())
def test_every_group_option_composes(primary, group, opt):
    cfg = _compose(primary, [f"{group}={opt}", *GROUP_REQUIRED.get((group, opt), [])])
    obj = OmegaConf.to_object(cfg)  # validates every value against the dataclass types
    assert isinstance(obj, PRIMARY[primary])
    check_values(primary, cfg)  # and against the declared ranges and rules
    if group == "recipe":
        assert obj.method == opt.split("-")[0]  # a recipe for a real target, <method>-<target>, runs its method


def test_every_recipe_header_has_its_launch_command():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        text = path.read_text()
        assert f"recipe={path.stem}" in text.split("\n\n")[0] or f"recipe={path.stem}" in text[:600], path


def test_unknown_key_is_an_error_in_the_schema():
    with pytest.raises(Exception, match="max_stepz"):
        _compose("train", ["train.max_stepz=3"])


def test_shorthands():
    assert expand_shorthands(["target=builtin"]) == ["target=builtin"]
    assert expand_shorthands(["target=/models/llama"]) == ["target=hf", "target.name_or_path=/models/llama"]
    assert expand_shorthands(["data=chats.jsonl"]) == ["data=jsonl", "data.path=chats.jsonl"]
    assert expand_shorthands(["data=builtin", "x=1"]) == ["data=builtin", "x=1"]


def test_hydra_flags_are_not_checked_as_overrides():
    args = ["recipe=eagle3", "--cfg", "job", "-p", "method", "--info", "-m", "x=1", "--info", "searchpath", "--cfg=all"]
    assert _without_hydra_flags(args) == ["recipe=eagle3", "x=1"]


@pytest.mark.slow
def test_cli_prints_the_job_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "train", "recipe=eagle3", "--cfg", "job"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "method: eagle3" in r.stdout.splitlines()
    assert not any(tmp_path.iterdir())  # printing the config starts no run


@pytest.mark.slow
@pytest.mark.parametrize("override,needle", [
    ("train.max_stepz=3", "max_stepz"),
    ("train.max_steps=abc", "train.max_steps"),
    ("eagle3.ttt_stepz=2", "ttt_stepz"),
    ("train.optimizer=sgd", "train.optimizer"),
    ("train.ema_decay=1.0", "train.ema_decay"),
    ("recipe=nope", "recipe/nope"),
])
def test_cli_bad_override_is_one_line_exit_2(override, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "train", override, f"hydra.run.dir={tmp_path}/r"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert not (tmp_path / "r").exists()  # nothing was started


def test_every_primary_config_is_covered():
    assert {p.stem for p in CONF_DIR.glob("*.yaml")} == set(PRIMARY)


@pytest.mark.parametrize("overrides", [
    ["capture.mode=offline", "capture.path=feats", "capture.verify=full", "train.eval_checkpoints=true"],
    ["capture.dtype=float32", "capture.batch_size=2", "capture.shard_mb=0.5"],
])
def test_capture_keys_compose_in_train(overrides):
    obj = OmegaConf.to_object(_compose("train", overrides))
    assert isinstance(obj.capture, C.CaptureConfig)


def test_capture_and_export_require_their_paths():
    from drafttrain.capture.capture import run_capture_job
    from drafttrain.io import DraftTrainError

    with pytest.raises(Exception, match="drafter"):
        OmegaConf.to_object(_compose("export", []))
    with pytest.raises(DraftTrainError, match="capture.path is required"):
        run_capture_job(OmegaConf.to_object(_compose("capture", [])))


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, tree


# the method recipes; the recipes for real targets (<method>-<target>) build on them: tests/test_recipes_real.py
@pytest.mark.parametrize("recipe", [r for r in _options("recipe") if r in C.TRAIN_METHODS])
def test_recipes_state_only_what_differs_from_the_schema(recipe):
    """config.py owns every default: a recipe that restated one would silently override a change made there.
    Each key a recipe sets (its `method` aside, which names it) must exist in the schema and differ from it."""
    import yaml

    schema = dict(_flat(OmegaConf.to_container(OmegaConf.structured(C.TrainJob))))
    stated = dict(_flat(yaml.safe_load((CONF_DIR / "recipe" / f"{recipe}.yaml").read_text())))
    assert stated.get("method") == recipe
    for key, value in stated.items():
        assert key in schema, f"recipe {recipe}: {key} is not a TrainJob key"
        if key == "method":
            continue
        default = schema[key]
        same = value == default or (isinstance(default, float) and float(value) == default)
        assert not same, f"recipe {recipe}: {key}={value!r} restates the schema default"


def test_the_builtin_data_is_half_sampled_for_capture_and_every_recipe():
    """data=builtin: half the answers sampled at T 0.7, half greedy (bench/notebook/training_quality.md section 2), one
    definition: `drafttrain capture` and every recipe read the same rows, so offline features match online
    training (tests/test_capture.py)."""
    datas = [_compose("capture", ["capture.path=x"]).data] + [_compose("train", [f"recipe={r}"]).data
                                                              for r in _options("recipe")]
    builtin = [d for d in datas if d.source == "builtin"]
    assert len(builtin) > len(C.TRAIN_METHODS)  # capture and each method's recipe (the real-target ones: files)
    assert {(d.regen_temperature, d.regen_sampled_fraction) for d in builtin} == {(0.7, 0.5)}


def test_every_train_default_is_some_recipes():
    """No schema default of the train section is dead: each one is what at least one recipe runs with."""
    import yaml

    schema = dict(_flat(OmegaConf.to_container(OmegaConf.structured(C.TrainJob))))
    train_keys = [k for k in schema if k.startswith("train.")]
    recipes = [dict(_flat(yaml.safe_load((CONF_DIR / "recipe" / f"{r}.yaml").read_text())))
               for r in _options("recipe")]
    dead = [k for k in train_keys if all(k in r for r in recipes)]
    assert not dead, f"every recipe overrides {dead}: the schema default is used by none"


def test_the_lab_comparisons_overrides_compose():
    """scripts/compare.py's rows (the notebook's ablations) are override lists: each must still compose and pass
    the checks, or a renamed key would fail only when an experiment is rerun."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare", REPO / "scripts" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    for name, (recipe, extra, _) in compare.METHODS.items():
        job, base = ("eval", []) if recipe is None else ("train", [f"recipe={recipe}"])
        check_values(job, _compose(job, [*base, *extra]))


def test_dflash_recipe_drafts_its_whole_block():
    """The built-in recipe's block (8, chosen by measurement) sets its draft length to B - 1; a block given on the
    command line moves it too; the real-target recipe keeps the published block 16."""
    def job(overrides):
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(C.TrainJob),
                                                   _compose("train", expand_shorthands(overrides))))

    j = job(["recipe=dflash"])
    assert (j.dflash.block_size, j.decode.num_draft_tokens, j.decode.method) == (8, 7, "dflash")
    j = job(["recipe=dflash", "dflash.block_size=16"])
    assert j.decode.num_draft_tokens == 15
    assert job(["recipe=dflash-qwen3-8b"]).dflash.block_size == 16
