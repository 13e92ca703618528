#!/usr/bin/env python
"""Long-prompt evaluation rows: held-out prompts that carry a long context before the question.

    python scripts/long_prompts.py --corpus code --min-tokens 1536 --num 16 --target <dir> --out /tmp/long.jsonl
    drafttrain eval drafter=<run>/final data=jsonl data.eval_path=/tmp/long.jsonl data.num_eval=16 ...

Each row is one user turn: the full text of several held-out documents of the built-in corpus's ``eval`` split
(code: whole functions; docs: documentation chunks), then a held-out question of the same split (code: a
signature and docstring to complete; docs: a question about a documented name). Documents are added until the
prompt has at least ``--min-tokens`` tokens under the target's chat template; the answer is left empty, so
the file is read with ``prompts_only`` (``data.eval_path``). The rows are a function of (corpus, seed,
min-tokens, tokenizer), and never come from the splits drafters train on.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def long_rows(tokenizer, corpus: str, num: int, min_tokens: int, seed: int = 0) -> list[dict]:
    from drafttrain.data.builtin import builtin_conversations

    chats = builtin_conversations("eval", None, seed, corpus)
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        question = chats[i % len(chats)].messages[0]["content"]
        context, n = [], 0
        while n < min_tokens:
            c = rng.choice(chats)
            context.append(c.messages[0]["content"] + "\n" + c.messages[1]["content"])
            user = "\n\n".join(context) + "\n\n" + question
            n = len(tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
        rows.append({"id": f"long-{corpus}-{i}", "messages": [{"role": "user", "content": user}], "tokens": n})
    return rows


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from drafttrain.io import write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=("code", "docs"), default="code")
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer counts the tokens)")
    ap.add_argument("--num", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=1536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    rows = long_rows(AutoTokenizer.from_pretrained(a.target), a.corpus, a.num, a.min_tokens, a.seed)
    write_text(a.out, "".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in rows))
    lengths = sorted(r["tokens"] for r in rows)
    print(f"wrote {len(rows)} prompts to {a.out}: {lengths[0]}..{lengths[-1]} tokens (median "
          f"{lengths[len(lengths) // 2]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
