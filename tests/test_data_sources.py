"""data=hub / data=file (drafttrain.data.sources): datasets by name and split, parquet / arrow / JSON(L) files and
directories of them, the row presets (data.format), their one-line errors, and the selection of training and
evaluation rows from them (data/select.py, which train, capture, eval, bench and tune read)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from datasets import Dataset, DatasetDict
from omegaconf import OmegaConf

import drafttrain.config as C
from drafttrain.cli import expand_shorthands
from drafttrain.data.chat import read_conversations
from drafttrain.data.select import eval_conversations, load_training_data
from drafttrain.data.sources import read_source
from drafttrain.io import DraftTrainError
from drafttrain.validate import check_job, check_paths

from .conftest import TINY_BUILTIN_OVERRIDES

SINGLE = [
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b"}],
    [{"role": "user", "content": "What does len do?"}, {"role": "assistant", "content": "It counts items."}],
]
MULTI = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def sub(a, b):"},
     {"role": "assistant", "content": "    return a - b"}, {"role": "user", "content": "and mul?"},
     {"role": "assistant", "content": "def mul(a, b):\n    return a * b\n"}],
]
CHATS = SINGLE + MULTI
SG_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def _sharegpt(chat, i):
    return {"id": f"s{i}", "conversations": [{"from": SG_ROLE[m["role"]], "value": m["content"]} for m in chat]}


# every preset: (rows of CHATS in that shape, the conversations they hold, the ids they carry)
SHAPES = {
    "sharegpt": ([_sharegpt(c, i) for i, c in enumerate(CHATS)], CHATS, ["s0", "s1", "s2"]),
    "ultrachat": ([{"prompt": next(m["content"] for m in c if m["role"] == "user"), "prompt_id": f"p{i}",
                    "messages": c} for i, c in enumerate(CHATS)], CHATS, ["p0", "p1", "p2"]),
    "openai": ([{"id": f"o{i}", "messages": c} for i, c in enumerate(CHATS)], CHATS, ["o0", "o1", "o2"]),
    "magpie": ([{"uuid": f"u{i}", "instruction": c[0]["content"], "response": c[1]["content"], "model": "m"}
                for i, c in enumerate(SINGLE)], SINGLE, ["u0", "u1"]),
    "magpie_conversations": ([{"uuid": f"u{i}", **{k: v for k, v in _sharegpt(c, i).items() if k != "id"}}
                              for i, c in enumerate(CHATS)], CHATS, ["u0", "u1", "u2"]),
}


def _write(rows, path):
    """``rows`` as the file type ``path`` names (parquet, arrow via save_to_disk, JSON lines), by datasets."""
    ds = Dataset.from_list(rows)
    if path.suffix == ".parquet":
        ds.to_parquet(str(path))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        ds.to_json(str(path))
    else:
        ds.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("container", ["parquet", "arrow", "json", "jsonl"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_reads_to_the_same_messages(shape, container, tmp_path):
    rows, chats, ids = SHAPES[shape]
    path = _write(rows, tmp_path / (f"rows.{container}" if container != "arrow" else "rows_arrow"))
    preset = shape.split("_")[0]
    for fmt in ("auto", preset):
        convs = read_source(path, fmt=fmt)
        assert [c.messages for c in convs] == chats, (fmt, convs)
        # the preset's id column; a JSONL row with conversations / messages keeps its "id" under auto, as before
        want = [None] * len(ids) if (container, fmt, shape) in (
            ("jsonl", "auto", "ultrachat"), ("jsonl", "auto", "magpie_conversations")) else ids
        assert [c.id for c in convs] == want, (fmt, [c.id for c in convs])


def test_a_directory_of_split_files_and_a_saved_dataset_dict(tmp_path, monkeypatch):
    """UltraChat's layout (data/<split>-*.parquet): data.split picks the files; slices work; an unknown split is
    one line naming the splits there; a save_to_disk DatasetDict the same. Local files leave the datasets cache
    alone."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    rows = SHAPES["ultrachat"][0]
    (tmp_path / "uc" / "data").mkdir(parents=True)
    _write(rows, tmp_path / "uc" / "data" / "train_sft-00000-of-00001.parquet")
    _write(rows[:1], tmp_path / "uc" / "data" / "test_sft-00000-of-00001.parquet")
    for hub in (False, True):  # data=hub reads a local dataset directory through load_dataset too
        assert [c.id for c in read_source(tmp_path / "uc", "train_sft", hub=hub)] == ["p0", "p1", "p2"]
    assert [c.id for c in read_source(tmp_path / "uc", "test_sft")] == ["p0"]
    assert [c.id for c in read_source(tmp_path / "uc", "train_sft[1:]")] == ["p1", "p2"]
    with pytest.raises(DraftTrainError) as e:
        read_source(tmp_path / "uc")
    assert "\n" not in str(e.value) and "uc[train]" in str(e.value) and "train_sft" in str(e.value), str(e.value)
    DatasetDict({"test_sft": Dataset.from_list(rows[:1]), "train_sft": Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd"))
    assert len(read_source(tmp_path / "dd", "train_sft")) == 3
    arrow = next((tmp_path / "dd" / "train_sft").glob("*.arrow"))  # one .arrow file (any split name reads it)
    assert [c.id for c in read_source(arrow, "train_sft[:2]")] == ["p0", "p1"]
    with pytest.raises(DraftTrainError, match=r"dd\[train\]: no split 'train' \(splits: test_sft, train_sft"):
        read_source(tmp_path / "dd")
    assert not (tmp_path / "hf-cache").exists()


def test_unknown_schema_is_one_line_naming_columns_and_shapes(tmp_path):
    path = _write([{"text": "hi", "label": 1}], tmp_path / "plain.parquet")
    cases = [("auto", "no conversation columns (columns: text, label)"),
             ("sharegpt", 'data.format=sharegpt reads "conversations", not found (columns: text, label)')]
    for fmt, needle in cases:
        with pytest.raises(DraftTrainError) as e:
            read_source(path, fmt=fmt)
        msg = str(e.value)
        assert msg.startswith(f"{path}[train]: ") and needle in msg and "\n" not in msg, msg
        assert "conversations (ShareGPT" in msg and "messages (OpenAI" in msg and "instruction + response" in msg
    both = _write([{**SHAPES["openai"][0][0], "conversations": SHAPES["sharegpt"][0][0]["conversations"]}],
                  tmp_path / "both.parquet")
    with pytest.raises(DraftTrainError, match='both "conversations" and "messages" columns; choose one'):
        read_source(both)
    assert read_source(both, fmt="sharegpt")[0].messages == SINGLE[0]  # a named preset reads its columns
    for bad, why in (("x.txt", "unsupported file type '.txt'"), ("nope.parquet", "no such file or directory")):
        if bad == "x.txt":
            (tmp_path / bad).write_text("hi")
        with pytest.raises(DraftTrainError, match=why):
            read_source(tmp_path / bad)


def test_bad_rows_name_their_row_and_skip_invalid_counts_them(tmp_path, capsys):
    rows = [dict(r) for r in SHAPES["openai"][0]]
    rows[1] = {"id": "o1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    path = _write(rows, tmp_path / "rows.parquet")
    with pytest.raises(DraftTrainError) as e:
        read_source(path)
    assert str(e.value) == f"{path}[train] row 1: messages[1] (assistant): content is empty"
    capsys.readouterr()
    convs = read_source(path, skip_invalid=True)
    assert [c.id for c in convs] == ["o0", "o2"] and convs.skipped == [str(e.value)]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {path}[train]: skipped 1 rows; first: {e.value}"]
    assert convs[0].where == f"{path}[train] row 0"


def test_jsonl_rows_by_preset(tmp_path):
    """data=jsonl reads Magpie instruction/response rows too; a named preset refuses other rows by line."""
    path = _write(SHAPES["magpie"][0] + SHAPES["openai"][0][:1], tmp_path / "mixed.jsonl")
    convs = read_conversations(path)
    assert [c.messages for c in convs] == SINGLE + SINGLE[:1] and [c.line for c in convs] == [1, 2, 3]
    with pytest.raises(DraftTrainError) as e:
        read_conversations(path, fmt="magpie")
    assert str(e.value).startswith(f"{path}:3: data.format=magpie reads") and "(keys: id, messages)" in str(e.value)


def _data(**kw):
    cfg = OmegaConf.structured(C.DataConfig)
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return OmegaConf.to_object(cfg)


@pytest.fixture(scope="module")
def tok():
    from drafttrain.targets.builtin import train_tokenizer  # byte-level BPE: any text tokenises

    return train_tokenizer([m["content"] for c in CHATS for m in c], 300)


def test_training_and_evaluation_rows_of_a_dataset(tmp_path, tok):
    """Held-out rows, data.eval_split and data.eval_path work for datasets as for JSONL; eval_conversations (eval,
    bench, tune, offline training) gives the rows training held out."""
    rows = [_sharegpt(CHATS[i % 3], i) for i in range(6)]
    (tmp_path / "d").mkdir()
    _write(rows, tmp_path / "d" / "train-00000.parquet")
    _write(rows[:2], tmp_path / "d" / "test-00000.parquet")
    d = _data(source="file", path=str(tmp_path / "d"), num_eval=2)
    examples, evals, stats = load_training_data(SimpleNamespace(data=d), None, tok, "t", tmp_path)
    assert stats["rows"] == len(examples) == 4 and [c.id for c in evals] == ["s4", "s5"]
    assert evals.note.startswith(f"the last 2 of 6 rows of {tmp_path / 'd'}[train], held out")
    assert [c.id for c in eval_conversations(d)] == ["s4", "s5"]
    d = _data(source="file", path=str(tmp_path / "d"), num_eval=1, eval_split="test")
    examples, evals, _ = load_training_data(SimpleNamespace(data=d), None, tok, "t", tmp_path)
    assert len(examples) == 6 and [c.id for c in evals] == ["s0"] and evals.note.endswith("rows of "
                                                                                        f"{tmp_path / 'd'}[test]")
    assert [c.id for c in eval_conversations(d)] == ["s0"]
    prompts = _write([{"messages": [{"role": "user", "content": "hi"}]}], tmp_path / "prompts.jsonl")
    d = _data(source="hub", path=str(tmp_path / "d"), eval_path=str(prompts), num_eval=0)
    assert [c.messages for c in eval_conversations(d)] == [[{"role": "user", "content": "hi"}]]


def test_shorthands_configs_and_checks(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    monkeypatch.chdir(tmp_path)
    assert expand_shorthands(["data=a.parquet", "data=b.arrow", "data=dir", "data=org/name", "data=c.jsonl",
                              "data=builtin"]) == [
        "data=file", "data.path=a.parquet", "data=file", "data.path=b.arrow", "data=file", "data.path=dir",
        "data=hub", "data.path=org/name", "data=jsonl", "data.path=c.jsonl", "data=builtin"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = OmegaConf.structured(C.TrainJob)
    job.data.source = "hub"
    with pytest.raises(DraftTrainError, match=r"^data.path is required with data=hub"):
        check_job("train", job)
    job.data.path = "org/name"
    check_paths("train", job)  # a hub name stays a hub name
    job.data.source, job.data.path = "file", "nope/rows"  # not a hub name with data=file
    with pytest.raises(DraftTrainError, match=r"^data.path=nope/rows: no such file or directory$"):
        check_paths("train", job)
    job.data.source, job.data.path, job.data.subset = "jsonl", "x.jsonl", "default"
    with pytest.raises(DraftTrainError, match=r"^data.subset=default: only read with data=hub or data=file$"):
        check_job("train", job)


# ------------------------------------------------------------------------------- training runs, the CLI

TRAIN = [*TINY_BUILTIN_OVERRIDES, "logger=none", "recipe=eagle3", "train.max_steps=2", "train.batch_size=2",
         "train.micro_batch_size=2", "train.warmup_steps=1", "eagle3.ttt_steps=2", "data.max_length=256",
         "decode.max_new_tokens=8", "decode.num_prompts=1", "decode.num_draft_tokens=2", "decode.warmup=0",
         "decode.sweep=[]", "decode.plot=false"]


@pytest.fixture(scope="module")
def chats(tiny_builtin_target):
    from drafttrain.data.builtin import builtin_conversations

    return [c.messages for c in builtin_conversations("draft", 16, seed=1) if len(json.dumps(c.messages)) < 600][:6]


def _train_in_process(overrides, run):
    """``drafttrain train <overrides>`` in this process: the CLI's shorthands, composition and checks, then the
    library entry (no interpreter start per run)."""
    from accelerate.state import AcceleratorState, GradientState
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from drafttrain.cli import CONF_DIR
    from drafttrain.training import loop

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", overrides=expand_shorthands(overrides))
        check_job("train", cfg)
        run.mkdir()
        return loop.run_train(OmegaConf.to_object(cfg), run)
    finally:
        GlobalHydra.instance().clear()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parquet_dir", "sharegpt_jsonl", "ultrachat_parquet"])
def test_train_on_each_source(kind, chats, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    if kind == "parquet_dir":
        (tmp_path / "chats").mkdir()
        data = _write([{"messages": c} for c in chats], tmp_path / "chats" / "train-00000-of-00001.parquet").parent
    elif kind == "sharegpt_jsonl":
        data = _write([_sharegpt(c, i) for i, c in enumerate(chats)], tmp_path / "chats.jsonl")
    else:
        data = _write([{"prompt": c[0]["content"], "prompt_id": f"p{i}", "messages": c} for i, c in enumerate(chats)],
                      tmp_path / "chats.parquet")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    evaluate = kind == "ultrachat_parquet"  # one run also decodes its held-out row
    report = _train_in_process([f"data={data.name}", *TRAIN, f"data.num_eval={int(evaluate)}",
                                f"train.eval={str(evaluate).lower()}"], tmp_path / "run")
    out = capsys.readouterr().out
    assert f"data: {len(chats) - evaluate} training rows" in out, out
    hist = json.loads((tmp_path / "run" / "train_metrics.json").read_text())["history"]
    assert [h["step"] for h in hist] == [1, 2]
    if evaluate:
        assert report["prompts"] == 1 and report["outputs_match_baseline"] is True
        assert f"the last 1 of {len(chats)} rows of chats.parquet[train]" in out, out
    assert sorted(p.name for p in tmp_path.rglob("*") if "run" not in p.relative_to(tmp_path).parts) == before


@pytest.mark.slow
def test_cli_wrong_schema_is_one_line(tmp_path, tiny_builtin_target):
    data = _write([{"text": "hi", "label": 1}], tmp_path / "plain.parquet")
    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "train", f"data={data}", *TRAIN,
                        f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors == [f"error: {data}[train]: no conversation columns (columns: text, label); expected one of: "
                      "conversations (ShareGPT / Magpie: from, value), messages (OpenAI / UltraChat: role, content), "
                      "instruction + response (Magpie) (data.format=auto|sharegpt|ultrachat|magpie|openai)"], r.stderr
