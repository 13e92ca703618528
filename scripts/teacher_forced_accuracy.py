#!/usr/bin/env python
"""Teacher-forced accuracy of saved EAGLE-3 drafters per drafting step, on the target's own greedy answers.

    DRAFTTRAIN_CACHE=/tmp/dtcache OMP_NUM_THREADS=1 python scripts/teacher_forced_accuracy.py \
        --target builtin --num-prompts 64 RUN/final OTHER/drafter ...

The held-out prompts are those ``drafttrain eval`` decodes (``data=builtin``, ``data.num_eval`` =
``--num-prompts``); the target answers each greedily (``--max-new-tokens``, its stop tokens). Every drafter
(drafttrain's ``final/``, an export, or speculators' layout: whatever ``drafttrain.artifacts.load_drafter``
reads) then runs its training-time unroll (``ttt_forward``, K steps) over prompt + answer, and step i at index t
is scored against the answer token at t+2+i, at the indices where a decoder could start a chain (the token
step 0 embeds, x_{t+1}, is an answer token). Per step: the accuracy over all such indices, and the conditional
one (those whose earlier steps were all right: the contexts a greedy chain reaches, what the decoder's
per-position acceptance estimates from round starts only). A drafter whose decode-time acceptance falls below
these numbers at some position has a train / decode mismatch there; two drafters equal here but not in decoding
differ in something decoding does that the unroll does not.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+", help="saved drafter directories")
    ap.add_argument("--target", default="builtin", help="Hydra target group (builtin, builtin-docs) or a path")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-K", type=int, default=4, help="drafting steps scored")
    a = ap.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from drafttrain.artifacts import load_drafter
    from drafttrain.cli import CONF_DIR, expand_shorthands
    from drafttrain.data.chat import stop_token_ids
    from drafttrain.data.select import eval_conversations, eval_prompt_ids
    from drafttrain.targets.load import gather_taps, load_target, target_id

    torch.set_num_threads(1)
    overrides = ["recipe=eagle3", f"target={a.target}", "data=builtin", f"data.num_eval={a.num_prompts}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        job = OmegaConf.to_object(compose("train", overrides=expand_shorthands(overrides)))
    model, tok, path = load_target(job.target, device=torch.device("cpu"))
    model.eval()
    prompts = eval_prompt_ids(tok, eval_conversations(job.data, target_id(path)), a.num_prompts)
    eos = list(stop_token_ids(model, tok))
    rows = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=a.max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            ids = out[:, : len(p) + a.max_new_tokens]
            hidden = model.get_decoder()(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            rows.append((ids, len(p), hidden))
    K = a.K
    for d_path in a.drafters:
        drafter = load_drafter(d_path, torch.device("cpu"), target_model=model).eval()
        to_target = drafter.draft_target_ids()
        n, hit, cn, chit = (torch.zeros(K) for _ in range(4))
        with torch.no_grad():
            for ids, P, hidden in rows:
                T = ids.shape[1]
                taps = gather_taps(hidden, drafter.config.tap_layers).float()
                logits = drafter.ttt_forward(ids, taps, torch.ones(1, T, dtype=torch.long), K)
                t = torch.arange(T)
                right_so_far = None
                for i in range(K):
                    valid = (t >= P - 1) & (t + 2 + i < T)
                    answer = torch.full((T,), -1, dtype=torch.long)
                    answer[: max(T - 2 - i, 0)] = ids[0, 2 + i:]
                    right = (to_target[logits[i][0].argmax(-1)] == answer) & valid
                    reach = valid if right_so_far is None else valid & right_so_far
                    n[i] += valid.sum()
                    hit[i] += right.sum()
                    cn[i] += reach.sum()
                    chit[i] += (right & reach).sum()
                    right_so_far = right if right_so_far is None else right_so_far & right
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"{d_path}\n  accuracy per step      {fmt(hit / n)}  (positions {n.int().tolist()})\n"
              f"  conditional per step   {fmt(chit / cn)}  (positions {cn.int().tolist()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
