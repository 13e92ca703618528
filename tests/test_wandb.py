"""W&B logging: offline without an API key (online with one), and what a run logs, read back from the
offline run files (the ``run-*.wandb`` record log) of the shared 1-process reference run."""
from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest

from drafttrain.config import LoggerConfig
from drafttrain.io import DraftTrainError
from drafttrain.training.logging import tracker_for

from .test_distributed import reference_run


def read_wandb_records(path: Path) -> list:
    """Records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log blocks of
    32 KiB holding chunks (crc32 4 bytes, length 2, type 1: full/first/middle/last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf += payload
        if kind in (1, 4):  # full or last chunk
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def read_offline_run(run_dir: Path) -> tuple[Path, dict, dict]:
    """(the offline run directory, config, {step: merged history row})."""
    found = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(found) == 1, found
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    config, rows = {}, {}
    for r in read_wandb_records(Path(found[0])):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            config.update({key(it): json.loads(it.value_json) for it in items})
        elif kind == "history":
            row = {key(it): json.loads(it.value_json) for it in r.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return Path(found[0]).parent, config, rows


@pytest.fixture()
def no_wandb_env(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc entry for api.wandb.ai
    return monkeypatch


def test_offline_without_api_key_online_with_one(no_wandb_env, tmp_path):
    kind, kw = tracker_for(LoggerConfig(kind="wandb"), tmp_path)
    assert kind == "wandb" and kw["wandb"]["mode"] == "offline" and kw["wandb"]["dir"] == str(tmp_path)
    no_wandb_env.delenv("WANDB_MODE")
    no_wandb_env.setenv("WANDB_API_KEY", "0" * 40)
    assert tracker_for(LoggerConfig(kind="wandb"), tmp_path)[1]["wandb"]["mode"] == "online"
    no_wandb_env.delenv("WANDB_API_KEY")
    no_wandb_env.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "1" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert tracker_for(LoggerConfig(kind="wandb"), tmp_path)[1]["wandb"]["mode"] == "online"
    assert tracker_for(LoggerConfig(kind="wandb", mode="offline"), tmp_path)[1]["wandb"]["mode"] == "offline"


def test_logger_switch(no_wandb_env, tmp_path):
    assert tracker_for(LoggerConfig(kind="none"), tmp_path) == (None, {})
    assert tracker_for(LoggerConfig(kind="tensorboard"), tmp_path)[0] == "tensorboard"
    with pytest.raises(DraftTrainError, match="logger.kind=mlflow"):
        tracker_for(LoggerConfig(kind="mlflow"), tmp_path)


@pytest.mark.slow
def test_offline_run_files_hold_what_training_logged(tmp_path_factory, tiny_builtin_target):
    run = reference_run(tmp_path_factory)
    wdir, config, rows = read_offline_run(run)
    # the resolved config
    assert config["method"] == "eagle3" and config["train"]["max_steps"] == 4 and config["eagle3"]["ttt_steps"] == 3
    hist = {h["step"]: h for h in json.loads((run / "train_metrics.json").read_text())["history"]}
    assert sorted(s for s in rows if "train/loss" in rows[s]) == [1, 2, 3, 4]
    for step, h in hist.items():
        row = rows[step]
        for i in range(3):  # per TTT step: loss, accuracy, expected acceptance
            for m in ("loss", "acc", "accept"):
                assert row[f"train/{m}_{i}"] == pytest.approx(h[f"{m}_{i}"]), (step, m, i)
        assert row["train/loss"] == pytest.approx(h["loss"]) and row["train/lr"] == pytest.approx(h["lr"])
        assert row["train/tokens_per_s"] > 0
    # eval alpha / tau / speedup at every checkpoint (step 2) and at the end (step 4), and the plot as an image
    for step, report in ((2, run / "checkpoints" / "step_00000002" / "report.json"), (4, run / "report.json")):
        rep = json.loads(report.read_text())
        for k in ("alpha", "tau", "speedup"):
            assert rows[step][f"eval/{k}"] == pytest.approx(rep[k]), (step, k)
        img = rows[step]["eval/acceptance_per_position/path"]
        assert rows[step]["eval/acceptance_per_position/_type"] == "image-file"
        assert (wdir / "files" / img).stat().st_size > 1000
    assert 3 not in rows or "eval/tau" not in rows[3]
