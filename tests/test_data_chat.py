"""drafttrain.data.chat: JSONL reading/validation, assistant loss masks, prompts, collation."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from drafttrain.data import stdlib
from drafttrain.data.chat import (
    Conversation,
    collate,
    has_generation_markers,
    prompt_ids,
    read_conversations,
    tokenize_conversation,
    tokenize_conversations,
)
from drafttrain.io import DraftTrainError
from drafttrain.targets.builtin import CHAT_TEMPLATE, train_tokenizer

CHATS = [
    [
        {"role": "system", "content": "You complete Python functions."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "and subtract?"},
        {"role": "assistant", "content": "def sub(a, b):\n    return a - b\n"},
    ],
    [
        {"role": "user", "content": "def name(self):\n    \"\"\"The name.\"\"\""},
        {"role": "assistant", "content": "    return self._name"},
    ],
]
# Same chats without leading whitespace in assistant content (ChatML puts "\n" right before the content).
PROSE = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does len do?"},
        {"role": "assistant", "content": "It returns the number of items."},
        {"role": "user", "content": "And sorted?"},
        {"role": "assistant", "content": "It returns a new sorted list."},
    ]
]

CHATML_PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] }}{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    texts = [t for t in (stdlib.read_source(p) for p in stdlib.stdlib_files("target")[:12]) if t]
    return train_tokenizer(texts, 400)


@pytest.fixture(scope="module")
def chatml_tok(tok):
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return t


def _runs(ids, mask):
    """Contiguous masked spans."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ reading


def test_sharegpt_and_openai_shapes_read_the_same(tmp_path):
    oa = [{"id": f"c{k}", "messages": c} for k, c in enumerate(CHATS)] + [{"messages": PROSE[0]}]
    to_sg = {"system": "system", "user": "human", "assistant": "gpt"}
    sg = [
        {"id": "c0", "conversations": [{"from": to_sg[m["role"]], "value": m["content"]} for m in CHATS[0]]},
        # other assistant aliases
        {
            "id": "c1",
            "conversations": [
                {"from": "user", "value": CHATS[1][0]["content"]},
                {"from": "chatgpt", "value": CHATS[1][1]["content"]},
            ],
        },
        {"conversations": [{"from": r, "value": m["content"]} for r, m in zip(
            ["system", "human", "bard", "human", "bing"], PROSE[0])]},
    ]
    _write(tmp_path / "oa.jsonl", oa)
    # blank lines are allowed and keep line numbers honest
    (tmp_path / "sg.jsonl").write_text("\n".join(json.dumps(r) for r in sg[:2]) + "\n\n" + json.dumps(sg[2]) + "\n")
    a = read_conversations(tmp_path / "oa.jsonl")
    b = read_conversations(tmp_path / "sg.jsonl")
    assert [c.messages for c in a] == [c.messages for c in b] == CHATS + PROSE
    assert [c.id for c in a] == [c.id for c in b] == ["c0", "c1", None]
    assert [c.line for c in a] == [1, 2, 3] and [c.line for c in b] == [1, 2, 4]
    assert b[2].where.endswith("sg.jsonl:4") and b[2].row_id == 4


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_CASES = {
    "malformed_json": ('{"messages": [{"role": "user", "content": "hi"}', r"invalid JSON"),
    "missing_keys": ({"text": "hi", "label": 1}, r'neither "conversations" \(ShareGPT\) nor "messages"'),
    "unknown_role": (
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        r"messages\[0\]: unknown role 'robot'",
    ),
    "unknown_sharegpt_role": (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "y"}]},
        r"conversations\[1\]: unknown role 'function_call'",
    ),
    "empty_content": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        r"messages\[1\] \(assistant\): content is empty",
    ),
    "non_string_content": (
        {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]},
        r"conversations\[0\] \(user\): content must be a string, got int",
    ),
    "missing_content_key": (
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},
        r'messages\[0\] has no "content" key',
    ),
    "no_assistant": ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
                     r"conversation has no assistant turn"),
    "duplicate_id": ({"id": "a", **GOOD}, r"duplicate id 'a' \(first at line 1\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_row_names_file_and_line(tmp_path, case, capsys):
    bad, pattern = BAD_CASES[case]
    path = tmp_path / "chats.jsonl"
    _write(path, [{"id": "a", **GOOD}, GOOD, bad, GOOD])
    before = path.read_bytes()
    with pytest.raises(DraftTrainError) as e:
        read_conversations(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert re.search(pattern, msg), msg
    assert path.read_bytes() == before
    # skip_invalid: the other rows survive, the bad one is counted with its location
    capsys.readouterr()
    convs = read_conversations(path, skip_invalid=True)
    err = capsys.readouterr().err.strip().splitlines()  # one warning line, no Python warning machinery
    assert len(err) == 1 and err[0].startswith(f"warning: {path}: skipped 1 rows; first: {path}:3: "), err
    assert [c.line for c in convs] == [1, 2, 4]
    assert len(convs.skipped) == 1 and convs.skipped[0].startswith(f"{path}:3: ")
    assert path.read_bytes() == before


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DraftTrainError, match="file not found"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DraftTrainError, match="no conversations"):
        read_conversations(tmp_path / "empty.jsonl")


# ------------------------------------------------------------------------------------------------ masks


def test_loss_mask_is_exactly_assistant_content_plus_end(tok):
    assert has_generation_markers(tok)
    for chat in CHATS:
        ex = tokenize_conversation(tok, chat, max_length=None)
        ids, mask = ex["input_ids"], ex["loss_mask"]
        assert len(ids) == len(mask)
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # bos once, from the template
        runs = _runs(ids, mask)
        want = [m["content"] + "<|end|>" for m in chat if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == want
        assert all(r[-1] == tok.eos_token_id for r in runs)
        # nothing else is masked: the unmasked tokens are the template, the user/system turns and the role tags
        unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
        assert unmasked == "<|bos|>" + "".join(
            "<|assistant|>" if m["role"] == "assistant" else f"<|{m['role']}|>{m['content']}<|end|>" for m in chat
        )


def test_prefix_diff_fallback_matches_markers_on_builtin_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = re.sub(r"\{% (end)?generation %\}", "", CHAT_TEMPLATE)
    assert not has_generation_markers(plain) and "endgeneration" not in plain.chat_template
    for chat in CHATS + PROSE:
        assert tokenize_conversation(plain, chat, None) == tokenize_conversation(tok, chat, None)


def test_prefix_diff_fallback_matches_markers_on_chatml(chatml_tok):
    marked, plain = copy.deepcopy(chatml_tok), copy.deepcopy(chatml_tok)
    marked.chat_template, plain.chat_template = CHATML_MARKED, CHATML_PLAIN
    assert has_generation_markers(marked) and not has_generation_markers(plain)
    assert marked.apply_chat_template(PROSE[0], tokenize=False) == plain.apply_chat_template(PROSE[0], tokenize=False)
    a = tokenize_conversation(marked, PROSE[0], None)
    b = tokenize_conversation(plain, PROSE[0], None)
    assert a == b
    end = chatml_tok.convert_tokens_to_ids("<|im_end|>")
    runs = _runs(b["input_ids"], b["loss_mask"])
    assert [chatml_tok.decode(r) for r in runs] == [m["content"] + "<|im_end|>" for m in PROSE[0][2::2]]
    assert all(r[-1] == end for r in runs)  # the "\n" the template puts after <|im_end|> is not trained on


def test_prefix_unstable_template_is_a_clear_error(tok):
    t = copy.deepcopy(tok)
    # earlier assistant turns rendered differently from the last one (like templates that strip reasoning)
    t.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|assistant|>...<|end|>' }}"
        "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    conv = Conversation(messages=CHATS[0], path="chats.jsonl", line=7)
    with pytest.raises(DraftTrainError, match=r"^chats\.jsonl:7: .*not prefix-stable.*renders earlier turns"):
        tokenize_conversation(t, conv, None)


# ------------------------------------------------------------------------------------------------ lengths


def test_overlong_truncate_vs_skip_and_zero_trainable(tok):
    lens = [len(tokenize_conversation(tok, c, None)["input_ids"]) for c in CHATS]
    short, long_ = min(lens), max(lens)
    L = (short + long_) // 2
    assert short <= L < long_
    ex_t, st_t = tokenize_conversations(tok, CHATS, max_length=L, overlong="truncate")
    assert st_t["rows"] == 2 and st_t["truncated"] == 1 and st_t["skipped"] == 0
    assert max(len(e["input_ids"]) for e in ex_t) == L
    ex_s, st_s = tokenize_conversations(tok, CHATS, max_length=L, overlong="skip")
    assert st_s["rows"] == 1 and st_s["truncated"] == 0 and st_s["skipped"] == 1
    assert len(ex_s[0]["input_ids"]) == short
    assert st_s["trainable_tokens"] == sum(ex_s[0]["loss_mask"]) > 0
    assert st_t["trainable_tokens"] == sum(sum(e["loss_mask"]) for e in ex_t) > st_s["trainable_tokens"]
    # truncation that cuts away every assistant token skips the row; nothing left at all is an error
    with pytest.raises(DraftTrainError, match="zero trainable \\(assistant\\) tokens"):
        tokenize_conversations(tok, CHATS, max_length=6, overlong="truncate")
    with pytest.raises(DraftTrainError, match="overlong='drop'"):
        tokenize_conversations(tok, CHATS, max_length=L, overlong="drop")


def test_prompt_ids_is_generation_prompt_prefix(tok):
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    for chat in CHATS:
        full = tokenize_conversation(tok, chat, None)["input_ids"]
        p = prompt_ids(tok, chat)
        assert p[-1] == assistant and full[: len(p)] == p
        # what follows the prompt is exactly the last assistant turn
        assert tok.decode(full[len(p) :]) == chat[-1]["content"] + "<|end|>"
        assert p.count(tok.bos_token_id) == 1


def test_collate_right_pads(tok):
    exs, _ = tokenize_conversations(tok, CHATS, max_length=None)
    batch = collate(exs, pad_id=tok.pad_token_id)
    n = [len(e["input_ids"]) for e in exs]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["loss_mask"].shape == (2, max(n))
    assert batch["input_ids"].dtype == torch.long
    for b, e in enumerate(exs):
        assert batch["input_ids"][b, : n[b]].tolist() == e["input_ids"]
        assert batch["loss_mask"][b, : n[b]].tolist() == e["loss_mask"]
        assert batch["attention_mask"][b].tolist() == [1] * n[b] + [0] * (max(n) - n[b])
        assert (batch["input_ids"][b, n[b] :] == tok.pad_token_id).all()
        assert (batch["loss_mask"][b, n[b] :] == 0).all()


@pytest.mark.parametrize("last", [
    {"role": "assistant", "content": ""}, {"role": "assistant", "content": "  "}, None,
])
def test_eval_prompts_may_end_without_an_answer_training_rows_may_not(tmp_path, last):
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = [{"messages": turns + ([last] if last else [])}, GOOD]
    path = tmp_path / "prompts.jsonl"
    _write(path, rows)
    with pytest.raises(DraftTrainError, match=rf"^{path}:1: "):
        read_conversations(path)  # training needs the answer
    convs = read_conversations(path, prompts_only=True)
    assert convs[0].messages == turns and len(convs) == 2
    assert convs[1].messages == GOOD["messages"]


def test_eval_prompts_still_refuse_an_empty_turn_before_the_end_and_a_row_without_a_user(tmp_path):
    path = tmp_path / "prompts.jsonl"
    _write(path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                {"role": "user", "content": "again"}]}])
    with pytest.raises(DraftTrainError, match=r":1: messages\[1\] \(assistant\): content is empty"):
        read_conversations(path, prompts_only=True)
    _write(path, [{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": ""}]}])
    with pytest.raises(DraftTrainError, match=r":1: conversation has no user turn"):
        read_conversations(path, prompts_only=True)


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_no_trainable_token_names_the_file_the_held_out_rows_and_the_overlong_count(tok, tmp_path, overlong):
    """A 10-row file whose every row is too long: the error names the file, says that 9 rows went to the held-out
    split (data.num_eval) and that the 1 training row is longer than data.max_length."""
    from drafttrain.config import TrainJob
    from drafttrain.data.select import load_training_data

    data = tmp_path / "chats.jsonl"
    row = {"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "ok"}]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(10)))
    job = TrainJob()
    job.data.source, job.data.path, job.data.max_length, job.data.overlong = "jsonl", str(data), 32, overlong
    with pytest.raises(DraftTrainError) as e:
        load_training_data(job, None, tok, "t", tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{data}: zero trainable (assistant) tokens in the 1 training conversation (1 longer "
                          "than data.max_length=32"), msg
    assert "the other 9 of its 10 rows are held out for evaluation (data.num_eval=16)" in msg
    job.data.num_eval = 0  # every row trains: no held-out part to name
    with pytest.raises(DraftTrainError, match=r"in the 10 training conversations \(10 longer than") as e:
        load_training_data(job, None, tok, "t", tmp_path)
    assert "held out" not in str(e.value)
