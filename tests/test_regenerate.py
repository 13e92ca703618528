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
    """A plain, unbatched greedy `generate` call on the whole of ``messages`` (the turns before the answer): the
    reference for what regenerate must write."""
    ids = torch.tensor([tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=True)["input_ids"]])
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_builtin_dataset_mixes_sampled_and_greedy_answers(target, tmp_path):
    """data.regen_sampled_fraction: the first round(f * n) chats answered by sampling, the rest greedily (each
    part its own cache), rows in the shuffle's order; the greedy rows equal an all-greedy regeneration's."""
    model, tok = target
    kw = dict(target_id="tiny-builtin", num_train=5, num_eval=0, max_new_tokens=MAX_NEW, batch_size=4,
              cache_dir=tmp_path, seed=0, progress=False)
    greedy, _ = builtin_dataset(model, tok, **kw)
    sampled, _ = builtin_dataset(model, tok, **kw, temperature=1.5)
    mixed, _ = builtin_dataset(model, tok, **kw, temperature=1.5, sampled_fraction=0.4)
    assert [c.id for c in mixed] == [c.id for c in greedy] == [c.id for c in builtin_conversations("draft", 5, seed=0)]
    for c in mixed[2:]:  # greedy answers do not depend on the batch they were generated in
        assert c.messages[1]["content"] == _direct_greedy(model, tok, c.messages[:1])
    assert [c.messages for c in mixed[:2]] != [c.messages for c in greedy[:2]]  # sampled at T = 1.5
    assert [c.messages for c in sampled] != [c.messages for c in greedy]
    assert len(list(tmp_path.glob("builtin-regen-*.jsonl"))) == 4  # greedy, sampled, and the mix's two parts
    again, _ = builtin_dataset(None, tok, **kw, temperature=1.5, sampled_fraction=0.4)  # from the caches
    assert [c.messages for c in again] == [c.messages for c in mixed]
    # fraction 1 is all sampled (the cache of temperature alone); with temperature 0 the fraction is moot
    assert [c.messages for c in builtin_dataset(None, tok, **kw, temperature=1.5, sampled_fraction=1.0)[0]] == \
        [c.messages for c in sampled]
    assert [c.messages for c in builtin_dataset(None, tok, **kw, sampled_fraction=0.4)[0]] == \
        [c.messages for c in greedy]



def test_builtin_dataset_further_answers_are_sampled_per_prompt(target, tmp_path):
    """data.regen_answers=2: the mix's rows, then every prompt again with a second answer sampled under a seed of
    its own (its own cache); further answers need a temperature; num_train=None is the whole draft split."""
    model, tok = target
    kw = dict(target_id="tiny-builtin", num_train=5, num_eval=0, max_new_tokens=MAX_NEW, batch_size=4,
              cache_dir=tmp_path, seed=0, progress=False, temperature=1.5, sampled_fraction=0.4)
    first, _ = builtin_dataset(model, tok, **kw)
    two, _ = builtin_dataset(model, tok, **kw, answers=2)
    assert len(two) == 10
    assert [c.messages for c in two[:5]] == [c.messages for c in first]
    assert [c.id for c in two[5:]] == [c.id for c in first]
    assert [c.messages[0] for c in two[5:]] == [c.messages[0] for c in first]  # the same prompts
    # answered again by sampling: not the first pass's answers (sampled rows: another seed; greedy rows: sampled)
    assert [c.messages[1] for c in two[5:]] != [c.messages[1] for c in first]
    assert [c.messages[1] for c in two[5:7]] != [c.messages[1] for c in first[:2]]
    assert len(list(tmp_path.glob("builtin-regen-*.jsonl"))) == 3  # the mix's two parts and the second answers
    again, _ = builtin_dataset(None, tok, **kw, answers=2)  # from the caches
    assert [c.messages for c in again] == [c.messages for c in two]
    # every answer sampled, the same rows in the same batches: only the second answers' own seed tells them apart
    alls, _ = builtin_dataset(model, tok, **{**kw, "sampled_fraction": 1.0}, answers=2)
    assert all(a.messages[1] != b.messages[1] for a, b in zip(alls[:5], alls[5:]))
    with pytest.raises(DraftTrainError, match="regen_answers=2.*regen_temperature"):
        builtin_dataset(None, tok, **{**kw, "temperature": 0.0}, answers=2)
    whole = builtin_conversations("draft", None, seed=0)
    assert [c.id for c in whole[:5]] == [c.id for c in first] and len(whole) > 5

# ------------------------------------------------------------------ truncation (turns stopped at max_new_tokens)
class _ScriptedTarget:
    """A stand-in target whose answer length is set by the prompt: the last ``<n=K>`` in it asks for K tokens
    (``x``) followed by eos, so which turns reach max_new_tokens without an eos is known exactly. Batched and
    left-padded like ``model.generate`` (finished rows padded)."""

    training = False
    config = None

    def __init__(self, tok):
        from transformers import GenerationConfig

        self.tok = tok
        self.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        self.x = tok.encode("x", add_special_tokens=False)[0]

    def parameters(self):
        return iter(())

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, generation_config):
        import re

        limit, pad = generation_config.max_new_tokens, generation_config.pad_token_id
        new = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            k = int(re.findall(r"<n=(\d+)>", text)[-1])
            new.append(([self.x] * k + [self.tok.eos_token_id])[:limit])
        width = max(len(r) for r in new)
        return torch.cat([input_ids, torch.tensor([r + [pad] * (width - len(r)) for r in new])], dim=1)


def _turns(*ks):
    msgs = []
    for k in ks:
        msgs += [{"role": "user", "content": f"<n={k}> def f{k}():"}, {"role": "assistant", "content": "old"}]
    return msgs


# max_new_tokens=8: K=7 is 7 tokens + eos (complete), K=8 reaches the limit before its eos (truncated)
TRUNC_ROWS = [("a", (3,)), ("b", (20,)), ("c", (8,)), ("g", (7,)), ("d", (2, 30)), ("e", (30, 2)), ("f", (1,))]
TRUNC_KW = dict(batch_size=3, max_new_tokens=8, progress=False)


@pytest.fixture()
def trunc_file(tmp_path):
    path = tmp_path / "trunc.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": _turns(*ks)}) + "\n" for i, ks in TRUNC_ROWS))
    return path


def test_truncated_turns_are_counted_and_reported(target, trunc_file, tmp_path):
    from drafttrain.data.regenerate import describe_stats

    fake = _ScriptedTarget(target[1])
    out = tmp_path / "out.jsonl"
    stats = regenerate_file(fake, fake.tok, trunc_file, out, **TRUNC_KW)
    # truncated turns: b, c, d's second, e's first (9 turns in all); rows: b, c, d, e
    assert (stats["turns"], stats["truncated_turns"], stats["truncated_rows"]) == (9, 4, 4)
    assert stats["dropped"] == stats["truncated_dropped"] == stats["truncated_cut"] == 0
    rows = {r["id"]: r["messages"] for r in _rows(out)}
    assert [len(rows[i]) for i, _ in TRUNC_ROWS] == [2, 2, 2, 2, 4, 4, 2]  # kept whole
    assert rows["c"][1]["content"] == "x" * 8 and rows["g"][1]["content"] == "x" * 7
    line = describe_stats(stats)
    assert "regenerated 7 rows (9 turns, " in line
    assert ("4 turns (44.4%) in 4 rows stopped at max_new_tokens=8 without an end token: raise max_new_tokens or "
            "set drop_truncated=true to keep them out of training") in line
    assert "{" not in line


def test_drop_truncated_keeps_exactly_the_complete_turns_and_resumes(target, trunc_file, tmp_path):
    from drafttrain.data.regenerate import describe_stats

    fake = _ScriptedTarget(target[1])
    kw = dict(TRUNC_KW, drop_truncated=True)
    full = tmp_path / "full.jsonl"
    stats = regenerate_file(fake, fake.tok, trunc_file, full, **kw)
    # e's second turn is never asked (its conversation ended before its truncated first turn): 8 turns
    assert (stats["turns"], stats["truncated_turns"], stats["truncated_rows"]) == (8, 4, 4)
    assert (stats["dropped"], stats["truncated_dropped"], stats["truncated_cut"]) == (3, 3, 1)
    rows = _rows(full)
    assert [r["id"] for r in rows] == [i for i, _ in TRUNC_ROWS]  # every row written, in input order
    assert [r["id"] for r in rows if "dropped" in r] == ["b", "c", "e"]
    assert all("max_new_tokens=8" in r["dropped"] for r in rows if "dropped" in r)
    kept = read_conversations(full)
    assert [c.row_id for c in kept] == ["a", "g", "d", "f"]
    d = next(c for c in kept if c.row_id == "d")
    assert [m["role"] for m in d.messages] == ["user", "assistant"] and d.messages[1]["content"] == "xx"
    assert "kept out (drop_truncated): 3 rows dropped, 1 rows ended before their truncated turn" in describe_stats(stats)

    # a crash after 2 rows (mid-chunk) + a torn third: the resumed output is byte-identical and counts the rest
    lines = full.read_bytes().split(b"\n")[:-1]
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:7])
    (tmp_path / "crashed.jsonl.meta.json").write_bytes((tmp_path / "full.jsonl.meta.json").read_bytes())
    stats = regenerate_file(fake, fake.tok, trunc_file, crashed, **kw)
    assert crashed.read_bytes() == full.read_bytes()
    assert (stats["already_done"], stats["rows"]) == (2, 5)
    assert (stats["truncated_turns"], stats["truncated_rows"], stats["truncated_dropped"], stats["truncated_cut"]) == \
        (3, 3, 2, 1)  # c, d's second turn, e
    # resuming with the other drop_truncated would mix two kinds of rows
    crashed.write_bytes(b"\n".join(lines[:2]) + b"\n")
    with pytest.raises(DraftTrainError, match=r"drop_truncated: True -> False"):
        regenerate_file(fake, fake.tok, trunc_file, crashed, **TRUNC_KW)
