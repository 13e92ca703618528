"""drafttrain.data.regenerate and data=builtin, with a tiny real built-in target (CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafttrain.data import stdlib
from drafttrain.data.builtin import builtin_conversations, builtin_dataset
from drafttrain.data.chat import prompt_ids, read_conversations
from drafttrain.data.regenerate import eos_token_ids, regenerate_conversations, regenerate_file
from drafttrain.io import DraftTrainError

MAX_NEW = 10


@pytest.fixture(scope="session")
def target(tiny_builtin_target):
    """The tiny built-in target shared by the whole session (tests/conftest.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_builtin_target))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_builtin_target)).eval()
    return model, tok


def _direct_greedy(model, tok, messages) -> str:
    """A plain, unbatched greedy `generate` call: the reference for what regenerate must write."""
    ids = torch.tensor([prompt_ids(tok, messages)])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
        pad_token_id=tok.pad_token_id, eos_token_id=eos_token_ids(model, tok),
    )[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in out:
        out = out[: out.index(tok.eos_token_id)]
    return tok.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def in_file(tmp_path_factory):
    """7 rows: code chats (with and without ids, varied prompt lengths) and one multi-turn chat with a system turn."""
    chats = stdlib.code_chats("draft")[:6]
    rows = [{"id": f"r{k}", "messages": c.messages()} for k, c in enumerate(chats[:3])]
    rows.append({"conversations": [
        {"from": "system", "value": "You write Python."},
        {"from": "human", "value": "def double(x):"},
        {"from": "gpt", "value": "    return 2 * x"},
        {"from": "human", "value": "def triple(x):"},
        {"from": "gpt", "value": "    return 3 * x"},
    ]})
    rows += [{"messages": c.messages()} for c in chats[3:]]
    path = tmp_path_factory.mktemp("regen") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_replaces_assistant_turns_with_greedy_output(target, in_file, tmp_path):
    model, tok = target
    before = in_file.read_bytes()
    out = tmp_path / "out.jsonl"
    stats = regenerate_file(model, tok, in_file, out, batch_size=3, max_new_tokens=MAX_NEW, progress=False)
    assert in_file.read_bytes() == before
    src, rows = read_conversations(in_file), _rows(out)
    assert stats["rows"] == len(rows) == len(src) == 7 and stats["already_done"] == 0
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", 4, 5, 6, 7]  # own id, else the line number
    assert stats["turns"] == 8
    for conv, row in zip(src, rows):
        assert "dropped" not in row
        got = row["messages"]
        assert [m["role"] for m in got] == [m["role"] for m in conv.messages]
        for a, b in zip(conv.messages, got):
            if a["role"] == "assistant":
                assert b["content"] != a["content"] and b["content"].strip()
            else:
                assert b == a
    # every turn is what an unbatched greedy generate gives, conditioned on the regenerated earlier turns
    # (rows 1, 2 are left-padded in their batch; row 3's second turn sees its own first answer)
    for k in (1, 2, 5):
        msgs = rows[k]["messages"]
        assert msgs[-1]["content"] == _direct_greedy(model, tok, msgs[:-1])
    multi = rows[3]["messages"]
    assert multi[2]["content"] == _direct_greedy(model, tok, multi[:2])
    assert multi[4]["content"] == _direct_greedy(model, tok, multi[:4])
    # the output is valid input again (OpenAI shape)
    assert [c.messages for c in read_conversations(out)] == [r["messages"] for r in rows]


def test_resume_after_crash_is_identical(target, in_file, tmp_path):
    model, tok = target
    kw = dict(batch_size=3, max_new_tokens=MAX_NEW, progress=False)
    full = tmp_path / "full.jsonl"
    regenerate_file(model, tok, in_file, full, **kw)
    reference = full.read_bytes()
    lines = reference.split(b"\n")[:-1]
    assert len(lines) == 7

    crashed = tmp_path / "crashed.jsonl"
    # 4 complete rows (a batch boundary is at 3: the resumed run must not change batch composition) + torn row
    crashed.write_bytes(b"\n".join(lines[:4]) + b"\n" + lines[4][: len(lines[4]) // 2])
    (tmp_path / "crashed.jsonl.meta.json").write_bytes((tmp_path / "full.jsonl.meta.json").read_bytes())
    stats = regenerate_file(model, tok, in_file, crashed, **kw)
    assert stats["already_done"] == 4 and stats["rows"] == 3
    assert crashed.read_bytes() == reference

    # rerun on a complete output: nothing to do, nothing changes
    stats = regenerate_file(model, tok, in_file, crashed, **kw)
    assert stats["rows"] == 0 and stats["already_done"] == 7
    assert crashed.read_bytes() == reference

    # a torn first line only
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(lines[0][:10])
    regenerate_file(model, tok, in_file, torn, **kw)
    assert torn.read_bytes() == reference


def test_regenerate_refuses_bad_outputs(target, in_file, tmp_path):
    model, tok = target
    kw = dict(batch_size=4, max_new_tokens=MAX_NEW, progress=False)
    with pytest.raises(DraftTrainError, match="output is the input file"):
        regenerate_file(model, tok, in_file, in_file, **kw)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "zzz", "messages": []}) + "\n")
    with pytest.raises(DraftTrainError, match=r"other\.jsonl:1: row id 'zzz' is not in the input"):
        regenerate_file(model, tok, in_file, other, **kw)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello world\n")
    with pytest.raises(DraftTrainError, match=r"junk\.jsonl:1: not a regenerate output row"):
        regenerate_file(model, tok, in_file, junk, **kw)
    assert junk.read_text() == "hello world\n"
    # resuming with other generation settings would mix them
    part = tmp_path / "part.jsonl"
    regenerate_file(model, tok, in_file, part, **kw)
    part.write_bytes(b"\n".join(part.read_bytes().split(b"\n")[:2]) + b"\n")
    with pytest.raises(DraftTrainError, match=r"max_new_tokens: 10 -> 5"):
        regenerate_file(model, tok, in_file, part, batch_size=4, max_new_tokens=5, progress=False)


def test_sampling_is_deterministic_given_seed(target):
    model, tok = target
    convs = [c.messages() for c in stdlib.code_chats("draft")[:3]]
    kw = dict(batch_size=3, max_new_tokens=MAX_NEW, temperature=1.0, progress=False)
    a, _ = regenerate_conversations(model, tok, convs, seed=1, **kw)
    b, _ = regenerate_conversations(model, tok, convs, seed=1, **kw)
    c, _ = regenerate_conversations(model, tok, convs, seed=2, **kw)
    assert a == b
    assert a != c


def test_builtin_dataset_regenerates_and_caches(target, tmp_path):
    model, tok = target
    kw = dict(target_id="tiny-builtin", num_train=5, num_eval=3, max_new_tokens=MAX_NEW, batch_size=4,
              cache_dir=tmp_path, seed=0, progress=False)
    train, evals = builtin_dataset(model, tok, **kw)
    originals = builtin_conversations("draft", 5, seed=0)
    assert [c.id for c in train] == [c.id for c in originals]
    for k, (o, c) in enumerate(zip(originals, train)):
        assert c.messages[0] == o.messages[0]  # same prompt
        assert c.messages[1]["content"].strip() and c.messages[1]["content"] != o.messages[1]["content"]
        if k in (0, 4):  # row 0 is left-padded in its batch, row 4 is alone in the second one
            assert c.messages[1]["content"] == _direct_greedy(model, tok, c.messages[:1])
    assert [c.id for c in evals] == [c.id for c in builtin_conversations("eval", 3, seed=0)]
    assert {p.split(":")[0] for p in (c.id for c in evals)}.isdisjoint({p.split(":")[0] for p in (c.id for c in train)})
    cached = list(tmp_path.glob("builtin-regen-*.jsonl"))
    assert len(cached) == 1
    # second call: served from the cache, the model is not needed
    train2, _ = builtin_dataset(None, tok, **kw)
    assert [c.messages for c in train2] == [c.messages for c in train]
    # a different key (num_train) is a different cache entry and needs the model
    with pytest.raises(DraftTrainError, match="no target model"):
        builtin_dataset(None, tok, **{**kw, "num_train": 4})
    # data=builtin without regeneration keeps the stdlib answers
    raw, _ = builtin_dataset(None, tok, **{**kw, "regenerate": False})
    assert [c.messages for c in raw] == [c.messages for c in originals]
