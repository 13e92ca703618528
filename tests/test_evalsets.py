"""Standard evaluation sets (eval.set): the question.jsonl reader, HumanEval, selection, turn-by-turn prompts with the
target's own answers, and the per-category report (τ, α, speedup per category; the pooled total)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from drafttrain.data.questions import HUMANEVAL, humaneval_questions, load_question_set, read_questions
from drafttrain.io import DraftTrainError

pytestmark = pytest.mark.usefixtures("one_thread")

EVALSETS = Path(__file__).resolve().parents[2] / "shared" / "evalsets"
SPEC_BENCH = EVALSETS / "spec_bench" / "question.jsonl"
needs_evalsets = pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="../shared/evalsets is not beside the checkout")


def _sel(set_, categories=None, per_category=0, max_turns=0):
    return SimpleNamespace(set=str(set_), categories=categories, per_category=per_category, max_turns=max_turns)


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ reading


@needs_evalsets
def test_spec_bench_reads_480_questions_in_13_categories_with_two_turn_mt_bench():
    qs = read_questions(SPEC_BENCH)
    cats = {}
    for q in qs:
        cats.setdefault(q.category, []).append(q)
    assert len(qs) == 480 and len(cats) == 13
    assert {len(cats[c]) for c in ("translation", "summarization", "qa", "math_reasoning", "rag")} == {80}
    assert all(len(q.turns) == 2 for q in cats["writing"]) and all(len(q.turns) == 1 for q in cats["qa"])


@needs_evalsets
def test_eagle_sets_without_a_category_are_filed_under_their_folder():
    qs = read_questions(EVALSETS / "eagle" / "alpaca" / "question.jsonl")  # category "" in the file
    assert len(qs) == 80 and {q.category for q in qs} == {"alpaca"}
    qs = load_question_set(_sel(EVALSETS / "eagle" / "mt_bench")).questions  # a folder holding question.jsonl
    assert len(qs) == 80 and max(len(q.turns) for q in qs) == 2


def test_humaneval_comes_from_the_package_as_one_category():
    qs = humaneval_questions()
    assert len(qs) == 164 and {q.category for q in qs} == {HUMANEVAL}
    assert qs[0].qid == "HumanEval/0" and "def has_close_elements" in qs[0].turns[0]


@pytest.mark.parametrize("line,needle", [
    ("{not json", "not valid JSON"),
    ('{"question_id": 2, "category": "a", "turns": []}', "'turns' must be a non-empty list"),
    ('{"question_id": 2, "category": "a", "turns": ["x", 3]}', "'turns' must be a non-empty list"),
    ('{"category": "a", "turns": ["x"]}', "no 'question_id'"),
    ('{"question_id": 1, "category": "a", "turns": ["x"]}', "question_id 1 repeats line 1"),
    ('[1, 2]', "expected a JSON object"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, needle):
    p = _write(tmp_path / "question.jsonl", [{"question_id": 1, "category": "a", "turns": ["hi"]}, "", line])
    with pytest.raises(DraftTrainError) as e:
        read_questions(p)
    assert f"{p}:3:" in str(e.value) and needle in str(e.value)


def test_selection_by_category_count_and_turns(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", f"follow-up {i}"]}
            for i, c in enumerate(["a", "b", "a", "b", "a", "c"])]
    p = _write(tmp_path / "question.jsonl", rows)
    qs = load_question_set(_sel(p, per_category=2)).questions
    assert [q.qid for q in qs] == ["0", "1", "2", "3", "5"]
    qs = load_question_set(_sel(p, categories=["c", "a"], max_turns=1)).questions
    assert [q.qid for q in qs] == ["0", "2", "4", "5"] and all(q.turns == [f"q{q.qid}"] for q in qs)
    with pytest.raises(DraftTrainError, match=r"eval.categories: zz not in eval.set=.*its categories: a, b, c"):
        load_question_set(_sel(p, categories=["a", "zz"]))
    with pytest.raises(DraftTrainError, match="no such question file"):
        load_question_set(_sel(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------------- turn prompts and the report


@pytest.fixture(scope="module")
def target(tiny_builtin_target):
    from drafttrain.targets.load import load_target

    model, tok, _ = load_target(SimpleNamespace(name_or_path=str(tiny_builtin_target), dtype="float32", device="cpu",
                                                trust_remote_code=False, attn_implementation="sdpa", revision=None))
    return model, tok


def _decode(**kw):
    from drafttrain.config import DecodeConfig

    d = DecodeConfig(method="pld", max_new_tokens=12, num_draft_tokens=3, warmup=0, sweep_prompts=0, plot=True)
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def test_later_turns_carry_the_targets_own_greedy_answer(target, tmp_path):
    from drafttrain.data.chat import prompt_ids, stop_token_ids
    from drafttrain.decoding.engine import SpecDecoder
    from drafttrain.decoding.proposers import NoDraft
    from drafttrain.decoding.target import TargetRunner
    from drafttrain.evaluation.evalsets import turn_prompts

    model, tok = target
    p = _write(tmp_path / "question.jsonl", [
        {"question_id": 7, "category": "code", "turns": ["def add(a, b):\n    \"\"\"Add.\"\"\"\n", "Now subtract."]},
        {"question_id": 8, "category": "long", "turns": ["x " * 3000, "never asked"]},  # over the 2048-token context
    ])
    decode = _decode()
    convs, info = turn_prompts(model, tok, load_question_set(_sel(p)), decode)
    assert [(c.qid, c.turn, c.category) for c in convs] == [("7", 1, "code"), ("7", 2, "code")]
    assert info["skipped_turns"] == {"long": 2} and info["turn_prompts"] == 2 and info["questions"] == 2
    eos = stop_token_ids(model, tok)
    ar = SpecDecoder(TargetRunner(model, taps=None, cache="dynamic"), NoDraft(), 0)
    first = ar.generate(convs[0].ids, decode.max_new_tokens, eos)
    answer = tok.decode([t for t in first.tokens if t not in eos], skip_special_tokens=True)
    assert answer.strip()  # the history holds a real answer
    assert convs[1].ids == prompt_ids(tok, [{"role": "user", "content": "def add(a, b):\n    \"\"\"Add.\"\"\"\n"},
                                            {"role": "assistant", "content": answer},
                                            {"role": "user", "content": "Now subtract."}])


def test_the_report_has_a_row_per_category_pooling_to_the_total(target, tmp_path, capsys):
    from drafttrain.decoding.build import make_proposer
    from drafttrain.evaluation import evaluate
    from drafttrain.evaluation.evalsets import prompt_labels, turn_prompts

    model, tok = target
    p = _write(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "code", "turns": ["def mul(a, b):\n", "And divide?"]},
        {"question_id": 2, "category": "prose", "turns": ["Explain lists."]},
        {"question_id": 3, "category": "code", "turns": ["class Stack:\n"]},
    ])
    decode = _decode(repeats=2)
    convs, info = turn_prompts(model, tok, load_question_set(_sel(p)), decode)
    prompts = [c.ids for c in convs]
    proposer = make_proposer("pld", decode=decode, max_len=4096, device="cpu")
    rep = evaluate(model, tok, prompts, proposer, decode, tmp_path / "run", method="pld", target_name="tiny",
                   drafter_name=None, extra={"eval_set": info}, labels=prompt_labels(convs, len(prompts)))
    cats = {r["category"]: r for r in rep["categories"]}
    assert list(cats) == ["code", "prose"]
    assert (cats["code"]["questions"], cats["code"]["prompts"], cats["prose"]["prompts"]) == (2, 3, 1)
    assert sum(r["new_tokens"] for r in cats.values()) == rep["new_tokens"]
    assert all(r["outputs_match_baseline"] is True and r["decode"] == "pld, chain K=3, greedy (lossless)"
               for r in cats.values())
    rounds = {c: r["new_tokens"] / r["tau"] for c, r in cats.items()}  # pooled: tau of all = tokens / rounds
    assert rep["tau"] == pytest.approx(rep["new_tokens"] / sum(rounds.values()), rel=1e-9)
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["categories"] == rep["categories"] and saved["eval_set"]["set"] == str(p)
    assert (tmp_path / "run" / "categories.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "per category:" in out and "total (pooled)" in out and "prose" in out


def test_no_category_rows_without_a_question_set(target):
    from drafttrain.evaluation.evalsets import prompt_labels

    assert prompt_labels([{"messages": []}], 1) is None


# ------------------------------------------------------------------------------------------ the command


def test_eval_command_runs_humaneval_with_a_category_table(tiny_builtin_target, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from drafttrain.cli import CONF_DIR
    from drafttrain.evaluation import run_eval

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"target.name_or_path={tiny_builtin_target}", "decode.method=pld", "eval.set=humaneval",
                               "eval.per_category=3", "decode.max_new_tokens=8", "decode.repeats=1",
                               "decode.warmup=0", "decode.sweep_prompts=0", "decode.plot=false"])
    rep = run_eval(OmegaConf.to_object(cfg), tmp_path)
    assert rep["prompts"] == 3 and rep["eval_set"]["questions_in_file"] == 164
    assert [r["category"] for r in rep["categories"]] == [HUMANEVAL] and rep["categories"][0]["questions"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["eval.set=/nonexistent/question.jsonl"], "eval.set=/nonexistent/question.jsonl: no such question file"),
    (["eval.set=humaneval", "decode.num_prompts=4"], "decode.num_prompts=4 with eval.set"),
    (["eval.unknown=1"], "eval.unknown"),
])
def test_bad_eval_settings_are_one_line(tmp_path, args, needle):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "drafttrain.cli", "eval", "decode.method=ar", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=dict(os.environ))
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert needle in lines[0]
