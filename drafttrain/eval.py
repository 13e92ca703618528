"""Evaluate a drafter in the speculative decoder: AR baseline vs speculative, side by side.

For each held-out prompt the AR baseline and the speculative decoder run back to back (alternating which
goes first), on the same target and the same sampling settings, so the speed ratio is measured under the
same machine load. Writes ``report.json`` (and ``acceptance.png``) into the run directory.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .io import DraftTrainError, read_json, write_json

REPORT_KEYS = (
    "method", "target", "drafter", "prompts", "new_tokens", "num_draft_tokens", "temperature", "top_k", "top_p",
    "alpha", "acceptance_per_position", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup",
    "outputs_match_baseline", "train_estimated_tau",
)


def make_proposer(method: str, drafter=None, decode=None, max_len: int = 4096, device="cpu"):
    from .decoding.proposers import (DraftModelProposer, Eagle3ChainProposer, NoDraft, OracleProposer,
                                     PromptLookupProposer)

    if method == "eagle3":
        if drafter is None:
            raise DraftTrainError("decode.method=eagle3 needs a drafter (drafter=runs/<run>/final)")
        return Eagle3ChainProposer(drafter, max_len=max_len)
    if method == "ar":
        return NoDraft()
    if method == "pld":
        return PromptLookupProposer(max_ngram=decode.pld_max_ngram, num_tokens=decode.num_draft_tokens)
    if method == "oracle":
        return OracleProposer([])
    if method == "draft_model":
        if not decode.draft_model:
            raise DraftTrainError("decode.method=draft_model needs decode.draft_model=<dir of a causal LM>")
        from transformers import AutoModelForCausalLM

        dm = AutoModelForCausalLM.from_pretrained(decode.draft_model).eval().to(device)
        return DraftModelProposer(dm, max_len=max_len)
    raise DraftTrainError(f"decode.method={method}: expected one of ar, eagle3, pld, oracle, draft_model")


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    app = report.get("acceptance_per_position") or []
    rows = [
        ("method", report["method"]),
        ("target", report["target"]),
        ("prompts x new tokens", f"{report['prompts']} x {report['new_tokens'] // max(1, report['prompts'])} (avg)"),
        ("draft tokens K / temperature", f"{report['num_draft_tokens']} / {report['temperature']}"),
        ("alpha (accepted/drafted)", _fmt(report["alpha"])),
        ("acceptance per position", " ".join(_fmt(a, ".2f") for a in app) or "-"),
        ("tau (tokens per target forward)", _fmt(report["tau"])),
        ("train-estimated tau", _fmt(report.get("train_estimated_tau"))),
        ("tokens/s speculative | AR", f"{_fmt(report['tokens_per_s'], '.1f')} | "
                                      f"{_fmt(report['baseline_tokens_per_s'], '.1f')}"),
        ("speedup (same run, side by side)", _fmt(report["speedup"], ".2f") + "x"),
        ("time split target/draft/other", " / ".join(_fmt(report.get(k), ".0%") for k in
                                                   ("frac_target", "frac_draft", "frac_other"))),
        ("greedy outputs == AR", str(report["outputs_match_baseline"])),
    ]
    w = max(len(r[0]) for r in rows)
    print("\n".join(["", "=" * (w + 40)] + [f"{k.ljust(w)}  {v}" for k, v in rows] + ["=" * (w + 40)]), flush=True)


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    app = [a if a is not None else float("nan") for a in report.get("acceptance_per_position") or []]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.bar(range(1, len(app) + 1), app, color="#4C72B0")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['method']}: tau={_fmt(report['tau'], '.2f')}, speedup={_fmt(report['speedup'], '.2f')}x",
                 fontsize=9)
    fig.tight_layout()
    from .io import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


@torch.no_grad()
def evaluate(model, tokenizer, prompts: list[list[int]], proposer, decode, run_dir: Path | None, *,
             method: str, target_name: str, drafter_name: str | None, taps=None,
             train_estimated_tau: float | None = None, extra: dict | None = None) -> dict:
    """Run AR and speculative decoding on ``prompts`` side by side; return (and write) the report."""
    from .decoding.engine import SpecDecoder, aggregate
    from .decoding.proposers import NoDraft
    from .decoding.target import TargetRunner

    if not prompts:
        raise DraftTrainError("no evaluation prompts (data.num_eval / decode.num_prompts is 0?)")
    max_len = max(len(p) for p in prompts) + decode.max_new_tokens + decode.num_draft_tokens + 8
    eos = [t for t in {tokenizer.eos_token_id, *(_gen_eos(model))} if t is not None]
    kw = dict(temperature=decode.temperature, top_k=decode.top_k, top_p=decode.top_p)
    ar = SpecDecoder(TargetRunner(model, taps=None, max_len=max_len), NoDraft(), 0, seed=decode.seed, **kw)
    spec = SpecDecoder(TargetRunner(model, taps=taps, max_len=max_len), proposer, decode.num_draft_tokens,
                       seed=decode.seed, **kw)
    is_oracle = method == "oracle"

    def run_spec(i, p, ref):
        if is_oracle:
            proposer.set_reference(ref)
        return spec.generate(p, decode.max_new_tokens, eos, seed=decode.seed + i)

    for _ in range(decode.warmup):  # untimed: first calls pay for allocation and lazy initialisation
        ref = ar.generate(prompts[0], min(16, decode.max_new_tokens), eos, seed=decode.seed)
        run_spec(0, prompts[0], ref.tokens)
    ar_res, sp_res, match = [], [], []
    for rep in range(decode.repeats):
        for i, p in enumerate(prompts):
            if is_oracle or (i + rep) % 2 == 0:  # alternate the order; the oracle needs AR first
                a = ar.generate(p, decode.max_new_tokens, eos, seed=decode.seed + i)
                s = run_spec(i, p, a.tokens)
            else:
                s = run_spec(i, p, None)
                a = ar.generate(p, decode.max_new_tokens, eos, seed=decode.seed + i)
            ar_res.append(a)
            sp_res.append(s)
            match.append(a.tokens == s.tokens)
    A, S = aggregate(ar_res), aggregate(sp_res)
    greedy = decode.temperature == 0
    report = {
        "method": method,
        "target": target_name,
        "drafter": drafter_name,
        "prompts": len(prompts),
        "new_tokens": S["num_new_tokens"] // max(1, decode.repeats),
        "num_draft_tokens": decode.num_draft_tokens,
        "temperature": decode.temperature,
        "top_k": decode.top_k,
        "top_p": decode.top_p,
        "alpha": S["alpha"],
        "acceptance_per_position": S["acceptance_per_position"],
        "tau": S["tau"],
        "tokens_per_s": S["tokens_per_s"],
        "baseline_tokens_per_s": A["tokens_per_s"],
        "speedup": (S["tokens_per_s"] / A["tokens_per_s"]) if S["tokens_per_s"] and A["tokens_per_s"] else None,
        "outputs_match_baseline": all(match) if greedy else None,
        "train_estimated_tau": train_estimated_tau,
        "frac_target": S["frac_target"],
        "frac_draft": S["frac_draft"],
        "frac_other": S["frac_other"],
        "time_target_s": S["time_target"],
        "time_draft_s": S["time_draft"],
        "time_other_s": S["time_other"],
        "baseline_time_s": A["time_total"],
        "repeats": decode.repeats,
        "device": str(next(model.parameters()).device),
        "mismatched_prompts": [i for i, m in enumerate(match) if not m] if greedy else [],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if extra:
        report.update(extra)
    print_table(report)
    if run_dir is not None:
        run_dir = Path(run_dir)
        write_json(run_dir / "report.json", report)
        if decode.plot and report["acceptance_per_position"]:
            plot_acceptance(report, run_dir / "acceptance.png")
        print(f"[drafttrain] report: {run_dir / 'report.json'}", flush=True)
    return report


def _gen_eos(model) -> list[int]:
    gc = getattr(model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None) if gc is not None else None
    if e is None:
        return []
    return list(e) if isinstance(e, (list, tuple)) else [e]


def eval_prompt_ids(tokenizer, convs, limit: int) -> list[list[int]]:
    from .data.chat import prompt_ids

    out = []
    for c in convs[:limit]:
        out.append(prompt_ids(tokenizer, c.messages if hasattr(c, "messages") else c))
    return out


def evaluate_drafter(model, tokenizer, drafter, decode, eval_convs, run_dir, *, target_name, drafter_name,
                     train_estimated_tau=None) -> dict:
    """The end-of-training evaluation (also used by ``drafttrain eval``)."""
    drafter.eval()
    prompts = eval_prompt_ids(tokenizer, eval_convs, decode.num_prompts)
    max_len = max(len(p) for p in prompts) + decode.max_new_tokens + decode.num_draft_tokens + 8
    method = decode.method
    proposer = make_proposer(method, drafter=drafter, decode=decode, max_len=max_len)
    taps = tuple(drafter.config.tap_layers) if method == "eagle3" else None
    return evaluate(model, tokenizer, prompts, proposer, decode, run_dir, method=method, target_name=target_name,
                    drafter_name=drafter_name, taps=taps, train_estimated_tau=train_estimated_tau)


def load_drafter(path: str, device):
    cfg = read_json(Path(path) / "config.json")
    kind = cfg.get("drafter_type")
    if kind == "eagle3":
        from .drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter.from_pretrained(path, device=device)
    raise DraftTrainError(f"{path}/config.json: unknown drafter_type {kind!r}")


def eval_conversations(data_cfg):
    from .data.chat import read_conversations

    if data_cfg.source == "builtin":
        from .data.builtin import builtin_conversations

        return builtin_conversations("eval", data_cfg.num_eval, data_cfg.seed)
    if data_cfg.source == "jsonl":
        if data_cfg.eval_path:
            return read_conversations(data_cfg.eval_path, skip_invalid=data_cfg.skip_invalid)[: data_cfg.num_eval]
        if not data_cfg.path:
            raise DraftTrainError("data.path (or data.eval_path) is required with data=jsonl")
        convs = read_conversations(data_cfg.path, skip_invalid=data_cfg.skip_invalid)
        return convs[-data_cfg.num_eval:]
    raise DraftTrainError(f"data.source={data_cfg.source}: expected builtin or jsonl")


def run_eval(cfg) -> dict:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .targets.load import load_target, target_id

    job = OmegaConf.to_object(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    recorded = None
    if job.drafter:
        if not (Path(job.drafter) / "config.json").exists():
            raise DraftTrainError(f"drafter={job.drafter}: not a saved drafter directory (no config.json)")
        recorded = read_json(Path(job.drafter) / "config.json").get("target_name_or_path") or None
    if job.target.name_or_path == "auto":
        job.target.name_or_path = recorded if recorded and Path(recorded).exists() else (recorded or "builtin")
    model, tokenizer, path = load_target(job.target)
    tname = target_id(path)
    drafter = None
    if job.drafter:
        if recorded and recorded != tname:
            raise DraftTrainError(
                f"drafter={job.drafter} was trained for target {recorded}, but target={tname} was given"
            )
        drafter = load_drafter(job.drafter, next(model.parameters()).device)
        if drafter.config.vocab_size != model.get_output_embeddings().weight.shape[0]:
            raise DraftTrainError(
                f"drafter vocabulary ({drafter.config.vocab_size}) differs from the target's "
                f"({model.get_output_embeddings().weight.shape[0]})"
            )
    convs = eval_conversations(job.data)
    if drafter is None and job.decode.method == "eagle3":
        raise DraftTrainError("decode.method=eagle3 needs drafter=<saved drafter directory>")
    if drafter is not None:
        return evaluate_drafter(model, tokenizer, drafter, job.decode, convs, run_dir, target_name=tname,
                                drafter_name=job.drafter)
    prompts = eval_prompt_ids(tokenizer, convs, job.decode.num_prompts)
    max_len = max(len(p) for p in prompts) + job.decode.max_new_tokens + job.decode.num_draft_tokens + 8
    proposer = make_proposer(job.decode.method, decode=job.decode, max_len=max_len,
                             device=next(model.parameters()).device)
    return evaluate(model, tokenizer, prompts, proposer, job.decode, run_dir, method=job.decode.method,
                    target_name=tname, drafter_name=None)
