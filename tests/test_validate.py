"""Config values are checked when the config is loaded (drafttrain.validate): every numeric field has a
range, every enumerated field its choices, and a bad value, path or grammar is one ``error:`` line naming
the key, exit status 2, with nothing created and the inputs untouched."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import drafttrain.config as C
from drafttrain.io import DraftTrainError
from drafttrain.io import looks_local
from drafttrain.validate import JOB_SCHEMAS, check_fields, check_job, check_paths

from .conftest import REPO, TINY_BUILTIN_OVERRIDES

# string fields that are names, paths, specs or templates (no fixed set of values)
FREE_STRINGS = {
    "TargetConfig.name_or_path", "TargetConfig.attn_implementation", "TargetConfig.revision", "DataConfig.path",
    "DataConfig.eval_path", "MedusaConfig.init_heads", "LoraConfig.target_modules", "DistillConfig.pretrained",
    "DistillConfig.loss", "TrainConfig.resume", "DecodeConfig.draft_model", "DecodeConfig.grammar",
    "LoggerConfig.project", "LoggerConfig.run_name", "CaptureConfig.path", "ExportJob.drafter", "ExportJob.out",
    "ExportJob.verifier", "EvalJob.drafter", "BenchJob.drafter", "TuneJob.drafter",
    "RegenerateJob.input", "RegenerateJob.output", "RegenerateJob.model",
    "DataConfig.split", "DataConfig.subset", "DataConfig.eval_split", "EvalSetConfig.set", "EvalSetConfig.categories",
}


def _leaf_type(tp):
    """int / float / str / bool / a dataclass, through Optional[...] and List[...]; and the list depth."""
    depth = 0  # list nesting
    while typing.get_origin(tp) is not None:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        depth += typing.get_origin(tp) in (list, typing.List)
        tp = args[0]
    return tp, depth


def _schema_fields():
    """(job schema, dotted key, owner dataclass, field, leaf type, is_list) of every field of every job."""
    seen = []

    def walk(job, schema, prefix):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            tp, is_list = _leaf_type(hints[f.name])
            if dataclasses.is_dataclass(tp):
                walk(job, tp, f"{prefix}{f.name}.")
            else:
                seen.append((job, prefix + f.name, schema, f, tp, is_list))

    for job in JOB_SCHEMAS.values():
        walk(job, job, "")
    return seen


def _outside(rng: C.Range, is_int: bool) -> list:
    """Values just outside ``rng`` on each bounded side."""
    step = 1 if is_int else 0.5
    out = []
    if rng.ge is not None:
        out.append(rng.ge - step)
    if rng.gt is not None:
        out.append(rng.gt)
    if rng.le is not None:
        out.append(rng.le + step)
    if rng.lt is not None:
        out.append(rng.lt)
    return [int(v) if is_int else float(v) for v in out]


def _nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


FIELDS = _schema_fields()
NUMERIC = [x for x in FIELDS if x[4] in (int, float)]
ENUMERATED = [x for x in FIELDS if x[4] is str and f"{x[2].__name__}.{x[3].name}" not in FREE_STRINGS]
IDS = {id(x): f"{x[0].__name__}:{x[1]}" for x in FIELDS}


@pytest.mark.parametrize("job,key,owner,f,tp,is_list", NUMERIC, ids=[IDS[id(x)] for x in NUMERIC])
def test_every_numeric_field_has_a_range_and_out_of_range_is_one_line_naming_it(job, key, owner, f, tp, is_list):
    rng = f.metadata.get("range")
    assert isinstance(rng, C.Range), f"{owner.__name__}.{f.name} declares no range (use config.num(...))"
    bads = _outside(rng, tp is int)
    assert bads, f"{owner.__name__}.{f.name}: an unbounded range checks nothing"
    check_fields(OmegaConf.structured(job), job)  # the defaults are allowed
    for bad in bads:
        cfg = OmegaConf.structured(job)
        OmegaConf.update(cfg, key, _nest(bad, is_list), merge=False)
        with pytest.raises(DraftTrainError) as e:
            check_fields(cfg, job)
        msg = str(e.value)
        assert msg.startswith(f"{key}=") and str(rng) in msg and "\n" not in msg, msg


@pytest.mark.parametrize("job,key,owner,f,tp,is_list", ENUMERATED, ids=[IDS[id(x)] for x in ENUMERATED])
def test_every_enumerated_field_has_its_choices(job, key, owner, f, tp, is_list):
    meta = f.metadata
    assert "choices" in meta or "pattern" in meta, (
        f"{owner.__name__}.{f.name}: a string field needs config.one_of/matching, or a place in FREE_STRINGS")
    cfg = OmegaConf.structured(job)
    OmegaConf.update(cfg, key, _nest("no-such-value", is_list), merge=False)
    with pytest.raises(DraftTrainError, match=rf"^{key}=.*no-such-value.*: expected "):
        check_fields(cfg, job)


def test_eagle3_loss_choices_are_the_library_losses():
    from drafttrain.losses import EAGLE3_LOSSES

    assert C.EAGLE3_LOSSES == EAGLE3_LOSSES


def _job(name, **updates):
    cfg = OmegaConf.structured(JOB_SCHEMAS[name])
    for k, v in updates.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


@pytest.mark.parametrize("job,updates,needle", [
    ("train", {"train.batch_size": 12, "train.micro_batch_size": 8}, "train.batch_size=12: must be a multiple"),
    ("train", {"train.betas": [0.9]}, "train.betas=[0.9]: expected two"),
    ("train", {"eagle3.tap_layers": [1, 2]}, "eagle3.tap_layers=[1,2]: expected exactly 3"),
    ("train", {"eagle3.recompute_teacher": True, "eagle3.compact_teacher": False}, "eagle3.recompute_teacher=true needs"),
    ("train", {"method": "draft_model", "distill.loss": "fkl:0.5,kl2"}, "distill.loss=fkl:0.5,kl2"),
    ("train", {"method": "draft_model", "distill.init": "from_pretrained"}, "distill.pretrained is required"),
    ("train", {"target.builtin.hidden_size": 190}, "target.builtin.hidden_size=190: must be a multiple"),
    ("train", {"target.builtin.num_kv_heads": 3}, "target.builtin.num_heads=4: must be a multiple"),
    ("train", {"target.builtin.seq_len": 4096}, "target.builtin.seq_len=4096: must be <="),
    ("train", {"data.source": "jsonl"}, "data.path is required"),
    ("eval", {"decode.num_draft_tokens": 0}, "decode.num_draft_tokens=0: must be >= 1 for decode.method=eagle3"),
    ("eval", {"decode.method": "draft_model"}, "decode.draft_model is required"),
    ("eval", {"decode.tree.enabled": True, "decode.tree.depth": 2, "decode.tree.top_k": 2,
              "decode.tree.total_tokens": 7}, "decode.tree.total_tokens=7: must be <= "),
    ("eval", {"decode.buckets": [1, 4, 2]}, "decode.buckets=[1,4,2]: must be strictly increasing"),
    ("eval", {"decode.batch_size": 4, "decode.tree.enabled": True}, "decode.batch_size=4: decode.batch_size>1 "
     "supports chain methods only (ar, pld, eagle3, medusa, draft_model, dflash), eager and unconstrained; not "
     "decode.tree.enabled=true"),
    ("eval", {"decode.batch_size": 2, "decode.grammar": "json", "decode.static_shapes": True},
     "not decode.grammar=json, decode.static_shapes=true"),
    ("eval", {"decode.grammar": "regex:a{2,1}"}, "decode.grammar (regex:a{2,1}): not a valid grammar"),
    ("eval", {"decode.grammar": '{"type": "object", "properties": 3}'}, "decode.grammar"),
    ("tune", {"tree_sizes": [8, 8]}, "tree_sizes=[8,8]: must be strictly increasing"),
    ("bench", {"decode.buckets": [1, 4, 2]}, "decode.buckets=[1,4,2]: must be strictly increasing"),
    ("bench", {"decode.temperature": 0.7}, "decode.temperature=0.7: drafttrain bench does not read it (its rows are "
     "greedy, batch 1; it reads decode.num_prompts, decode.max_new_tokens"),
    ("bench", {"decode.batch_size": 4}, "decode.batch_size=4: drafttrain bench does not read it"),
    ("bench", {"decode.num_draft_tokens": 0}, "decode.num_draft_tokens=0: must be >= 1 (K of bench's draft_model"),
    ("bench", {"decode.method": "pld"}, "decode.method=pld: drafttrain bench does not read it (choose its rows with "
     "methods=[…]"),
    ("eval", {"data.num_eval": 0}, "data.num_eval=0 (every row of a prompt file) needs a file"),
    ("train", {"method": "dflash", "decode.method": "dflash", "dflash.block_size": 8, "decode.num_draft_tokens": 8},
     "decode.num_draft_tokens=8: a DFlash block of dflash.block_size=8 drafts at most 7 tokens"),
    ("train", {"method": "dflash", "dflash.target_layer_ids": []}, "dflash.target_layer_ids=[]: give at least one"),
    ("train", {"data.regen_answers": 2, "data.regen_temperature": 0.0}, "data.regen_answers=2: further answers are "
     "sampled, so it needs data.regenerate=true and data.regen_temperature > 0 (got True, 0)"),
    ("train", {"data.regen_answers": 2, "data.source": "jsonl", "data.path": "x.jsonl"},
     "data.regen_answers=2: only read with data=builtin"),
])
def test_cross_field_rules(job, updates, needle, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DraftTrainError) as e:
        check_job(job, _job(job, **updates))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_defaults_and_edge_values_pass(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_job("train", _job("train"))
    check_job("train", _job("train", **{"data.regen_answers": 2, "data.regen_temperature": 0.7, "data.num_train": None}))
    check_job("eval", _job("eval", **{"decode.method": "ar", "decode.num_draft_tokens": 0, "decode.top_p": 1.0}))
    check_job("bench", _job("bench", **{"decode.max_new_tokens": 8, "decode.repeats": 2, "decode.warmup": 0,
                                        "decode.tree.depth": 3, "decode.static_shapes": True, "decode.compile": True,
                                        "decode.buckets": [1, 4], "decode.draft_model": None}))
    check_job("eval", _job("eval", **{"decode.batch_size": 8, "decode.method": "pld", "decode.typical_acceptance": True}))
    check_job("eval", _job("eval", **{"decode.tree.enabled": True, "decode.tree.depth": 2, "decode.tree.top_k": 2,
                                      "decode.tree.total_tokens": 6, "decode.grammar": "regex:[a-z]{2,4}"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DraftTrainError, match=r"micro_batch_size \(8\) x 2 processes"):
        check_job("train", _job("train", **{"train.batch_size": 24}))


@pytest.mark.parametrize("value,local", [
    ("meta-llama/Llama-3.1-8B", False), ("gpt2", False), ("./model", True), ("/abs/model", True),
    ("~/model", True), ("runs/x/final", True), ("C:\\models\\x", True),
])
def test_looks_local(value, local):
    assert looks_local(value) is local


def test_paths_checked_by_kind(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("{}\n")
    check_paths("train", _job("train", **{"target.name_or_path": "org/hub-model", "data.source": "jsonl",
                                          "data.path": str(f)}))  # a hub name stays a hub name
    cases = [
        ("train", {"target.name_or_path": str(tmp_path / "nope")}, "target.name_or_path=", "no such directory"),
        ("train", {"data.source": "jsonl", "data.path": str(tmp_path / "nope.jsonl")}, "data.path=", "no such file"),
        ("train", {"data.source": "jsonl", "data.path": str(tmp_path)}, "data.path=", "not a file"),
        ("train", {"train.resume": "./no-checkpoint"}, "train.resume=./no-checkpoint", "no such directory"),
        ("train", {"capture.mode": "offline", "capture.path": str(f)}, "capture.path=", "not a directory"),
        ("train", {"method": "draft_model", "distill.init": "from_pretrained", "distill.pretrained": "./d"},
         "distill.pretrained=./d", "no such directory"),
        ("eval", {"drafter": "runs/one"}, "drafter=runs/one", "no such directory"),
        ("eval", {"decode.method": "draft_model", "decode.draft_model": "~/no-draft"}, "decode.draft_model=",
         "no such directory"),
        ("regenerate", {"input": "in.jsonl", "output": "out.jsonl"}, "input=in.jsonl", "no such file"),
    ]
    for job, updates, key, why in cases:
        with pytest.raises(DraftTrainError) as e:
            check_paths(job, _job(job, **updates))
        assert str(e.value).startswith(key) and str(e.value).endswith(why), str(e.value)


def test_known_failures_are_one_line_and_bugs_keep_their_traceback():
    from safetensors import SafetensorError

    from drafttrain.cli import known_failure

    assert known_failure(DraftTrainError("x: bad")) == "x: bad"
    assert known_failure(FileNotFoundError(2, "No such file or directory", "a/b.json")) == \
        "a/b.json: No such file or directory"
    assert "damaged" in known_failure(SafetensorError("invalid header length"))
    assert known_failure(RuntimeError("a bug")) is None
    assert known_failure(ValueError("a bug")) is None
    assert known_failure(KeyError("a bug")) is None


# ------------------------------------------------------------------------- through the command line


def _cli(args, cwd, timeout=300):
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", *args], capture_output=True, text=True,
                       cwd=cwd, timeout=timeout, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("args,needles", [
    (["eval", "decode.method=ar", "decode.temperature=-1"], ["decode.temperature=-1", ">= 0"]),  # was accepted
    (["eval", "decode.method=ar", "decode.top_p=2"], ["decode.top_p=2", "in (0, 1]"]),  # was a traceback
    (["train", "train.lr=-1"], ["train.lr=-1", "> 0"]),  # was torch/optim's traceback
    (["train", "recipe=medusa", "medusa.num_heads=0"], ["medusa.num_heads=0", ">= 1"]),
    (["eval", "decode.method=draft_model", "decode.draft_model=./no-draft"],  # was a hub traceback
     ["decode.draft_model=./no-draft", "no such directory"]),
    (["train", "recipe=draft_model", "distill.init=from_pretrained", "distill.pretrained=./no-draft"],
     ["distill.pretrained=./no-draft", "no such directory"]),
    (["eval", "decode.method=ar", "data=./no-prompts.jsonl"], ["data.path=./no-prompts.jsonl", "no such file"]),
    (["eval", "decode.method=ar", "decode.grammar=regex:a{2,1}"],  # was "mismatched input '{' expecting <EOF>"
     ["decode.grammar=regex:a{2,1}", "quote", "'decode.grammar=\"regex:a{2,1}\"'"]),
    (["eval", "decode.method=ar", 'decode.grammar="regex:a{2,1"'], ["decode.grammar", "regex", "not a valid grammar"]),
    (["train", "recipe=distill"], ["recipe=distill", "renamed recipe=draft_model"]),  # the family's old name
    (["capture", "method=distill", "capture.path=feats"], ["method=distill", "renamed method=draft_model"]),
    # keys an older release had elsewhere (config.MOVED_KEYS): the new key named
    (["train", "eagle3.topk_distill=3"], ["eagle3.topk_distill=3", "write eagle3.experimental.topk_distill=3"]),
    (["bench", "max_new_tokens=64"], ["max_new_tokens=64", "write decode.max_new_tokens=64"]),
])
def test_cli_bad_setting_is_one_line_before_anything_runs(args, needles, tmp_path):
    data = tmp_path / "keep.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    before = _digest(data)
    line = _cli([*args, f"hydra.run.dir={tmp_path}/run", "logger=none"], cwd=tmp_path)
    for needle in needles:
        assert needle in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]  # no run directory, nothing written
    assert _digest(data) == before


@pytest.mark.slow
def test_cli_damaged_target_weights_is_one_line_naming_the_target(tmp_path, tiny_builtin_target):
    target = tmp_path / "target"
    shutil.copytree(tiny_builtin_target, target)
    weights = target / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:8] + b"{not json" + raw[17:4096])
    before = _digest(weights)
    line = _cli(["eval", "decode.method=ar", f"target={target}", *TINY_BUILTIN_OVERRIDES,
                 f"hydra.run.dir={tmp_path}/run"], cwd=REPO)
    assert f"target.name_or_path={target}" in line and "cannot load the model weights" in line, line
    assert _digest(weights) == before


# ---------------------------------------------------------------------------------------- moved keys


@pytest.mark.parametrize("job,override,new", [
    ("train", "eagle3.topk_distill=3", "eagle3.experimental.topk_distill=3"),
    ("train", "+eagle3.align_top_k=1", "eagle3.experimental.align_top_k=1"),
    ("capture", "eagle3.init_layer=-1", "eagle3.experimental.init_layer=-1"),
    ("bench", "max_new_tokens=64", "decode.max_new_tokens=64"),
    ("bench", "runs=5", "decode.repeats=5"),
    ("bench", "tree.depth=3", "decode.tree.depth=3"),
    ("bench", "draft_model=null", "decode.draft_model=null"),
    ("tune", "num_prompts=2", "decode.num_prompts=2"),
])
def test_a_moved_key_is_one_line_naming_the_new_key(job, override, new, capsys):
    from drafttrain.cli import check_overrides

    with pytest.raises(SystemExit) as e:
        check_overrides(job, [override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and err.endswith(f"(write {new})"), err


def test_every_moved_key_is_gone_and_its_new_key_exists():
    """MOVED_KEYS names keys that no longer exist, each moved to one that does (or the hint would mislead)."""
    schema = {job: OmegaConf.structured(JOB_SCHEMAS[job]) for job in C.MOVED_KEYS}
    for job, moved in C.MOVED_KEYS.items():
        for old, new in moved.items():
            assert OmegaConf.select(schema[job], old, default="gone") == "gone", (job, old)
            assert OmegaConf.select(schema[job], new, default="gone") != "gone", (job, new)
    assert {f"eagle3.experimental.{n}" for n in C.EAGLE3_EXPERIMENTAL} == set(C.MOVED_KEYS["train"].values())


def test_a_moved_key_in_a_config_file_names_the_new_key():
    """The same key in a YAML file (a user's recipe) is reported at composition, with the same hint."""
    from drafttrain.cli import _describe_config_error

    with pytest.raises(Exception) as e:
        OmegaConf.merge(OmegaConf.structured(C.TrainJob), {"eagle3": {"score_prompt": True}})
    assert _describe_config_error(e.value, "train") == ("eagle3.score_prompt: this key is now "
                                                        "eagle3.experimental.score_prompt "
                                                        "(write eagle3.experimental.score_prompt=…)")
    with pytest.raises(Exception) as e:
        OmegaConf.merge(OmegaConf.structured(C.TrainJob), {"eagle3": {"score_prompz": True}})
    assert "unknown config key 'eagle3.score_prompz'" in _describe_config_error(e.value, "train")


def test_a_checkpoints_recorded_config_with_the_old_keys_still_loads(tmp_path):
    """A checkpoint written before the levers moved records them under eagle3.*: it is read with them moved,
    values kept, so it resumes and evaluates (training/checkpoint.read_checkpoint_meta)."""
    import json

    from drafttrain.training import checkpoint

    old = OmegaConf.to_container(OmegaConf.structured(C.TrainJob))
    experimental = old["eagle3"].pop("experimental")
    old["eagle3"].update(experimental, topk_distill=3, init_layer=-1)
    with pytest.raises(Exception):
        OmegaConf.merge(OmegaConf.structured(C.TrainJob), old)  # what an unmodified read would do
    (tmp_path / checkpoint.STATE).write_text(json.dumps({"method": "eagle3", "config": old}))
    meta = checkpoint.read_checkpoint_meta(tmp_path)
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(C.TrainJob), meta["config"]))
    assert job.eagle3.experimental.topk_distill == 3 and job.eagle3.experimental.init_layer == -1
    assert job.eagle3.ttt_steps == C.Eagle3Config().ttt_steps
    assert C.upgrade_recorded_config(meta["config"]) == meta["config"]  # today's layout is left as it is
