"""vLLM against drafttrain on the same prompt ids: export, serve with vLLM's offline ``LLM`` (in the engine venv,
through ``vllm_driver.py``), decode with drafttrain's own decoder, compare per prompt.

Per prompt (greedy): vLLM's output equals drafttrain's AR output token for token; vLLM's drafts (verify steps)
equal drafttrain's rounds and its accepted drafts equal drafttrain's, except that vLLM always proposes K tokens
and counts accepted drafts before cutting at ``max_tokens``, so on a prompt that ends by length its accepted
count may exceed ours (we draft only the remaining budget): that excess is allowed there and reported.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from ..io import DraftTrainError

DRIVER = Path(__file__).with_name("vllm_driver.py")
STAMP = ".drafttrain-stamp"
SPEC_METHOD = {"eagle3": "eagle3", "medusa": "medusa", "medusa2": "medusa", "draft_model": None, "dflash": "dflash"}


def engine_venv() -> Path:
    """Where scripts/make_engine_venv.sh builds the engine venv (``DRAFTTRAIN_ENGINE_VENV`` overrides)."""
    return Path(os.environ.get("DRAFTTRAIN_ENGINE_VENV") or Path.home() / ".cache" / "drafttrain" / "engine-venv")


def engine_python() -> Path | None:
    """The engine venv's python, None when the venv is absent or unfinished (no stamp)."""
    d = engine_venv()
    py = d / "bin" / "python"
    return py if (d / STAMP).is_file() and py.exists() else None


def require_engine_python(label: str = "") -> Path:
    """The engine venv's python, or one line saying how to build it (``label`` prefixes the message)."""
    py = engine_python()
    if py is None:
        raise DraftTrainError(f"{label}no engine venv at {engine_venv()} (build it: scripts/make_engine_venv.sh, or "
                              f"set DRAFTTRAIN_ENGINE_VENV)")
    return py


def run_engine_script(driver: Path, spec: dict, timeout: float | None, *, label: str = "", env: dict | None = None,
                      context: str = "") -> dict:
    """Run the engine-venv script ``driver`` on ``spec`` (written to a JSON file, the result read back from the
    one the script writes) in a temporary directory, offline, vLLM's CPU threads unbound; the result's JSON.
    ``env`` overrides the defaults (one OpenMP thread, 1 GiB KV cache, unless set already). A timeout or a failed
    run is one line (``label`` first, ``context`` after the target), then the script's stderr tail."""
    py = require_engine_python(label)
    with tempfile.TemporaryDirectory(prefix="drafttrain-vllm-") as d:
        sp, out = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        run_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        run_env.setdefault("OMP_NUM_THREADS", "1")
        run_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        run_env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
        try:
            r = subprocess.run([str(py), str(driver), str(sp), str(out)], capture_output=True, text=True,
                               timeout=timeout, env=run_env, cwd=d)
        except subprocess.TimeoutExpired:
            raise DraftTrainError(f"{label}vLLM did not finish within {timeout:.0f} s (target {spec['target']})") \
                from None
        if r.returncode != 0 or not out.exists():
            tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no stderr)"]
            raise DraftTrainError(f"{label}vLLM failed on target {spec['target']}{context}: {tail[0]}\n"
                                  f"{r.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_driver(spec: dict, timeout: float = 1200) -> dict:
    """Run ``vllm_driver.py`` on ``spec`` in the engine venv (one OpenMP thread); its JSON result."""
    return run_engine_script(DRIVER, spec, timeout, env={"OMP_NUM_THREADS": "1"},
                             context=f" with speculative_config {spec.get('speculative_config')}")


def speculative_config(kind: str, export_dir: str, K: int) -> dict:
    """vLLM's ``speculative_config`` for an exported drafter of ``kind`` (a drafttrain drafter_type)."""
    cfg = {"model": str(export_dir), "num_speculative_tokens": int(K)}
    if SPEC_METHOD[kind]:
        cfg["method"] = SPEC_METHOD[kind]
    return cfg


def ours(model, tokenizer, drafter, method: str, prompts: list[list[int]], K: int, max_new_tokens: int,
         temperature: float = 0.0, seed: int = 0, draft_temperature: float | None = None) -> list[dict]:
    """drafttrain's decode of ``prompts``: per prompt the AR tokens and the speculative decoder's tokens, rounds,
    drafted and accepted counts (per position too). ``draft_temperature=0``: argmax drafts, as vLLM's EAGLE /
    draft-model proposers draft by default when sampling."""
    from ..config import DecodeConfig
    from ..decoding.build import decode_cache_length, make_proposer, target_taps
    from ..evaluation.measure import prepare

    decode = DecodeConfig(method=method, num_draft_tokens=K, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed, draft_temperature=draft_temperature, warmup=0, sweep_prompts=0, plot=False)
    proposer = make_proposer(method, drafter, decode, max_len=decode_cache_length(prompts, decode))
    run = prepare(model, tokenizer, prompts, proposer, decode, method=method,
                  taps=target_taps(method, drafter, model))
    rows = []
    for i, p in enumerate(prompts):
        ar = run.run_ar(i, p)
        sp = run.run_spec(run.spec, i, p, ar.tokens)
        rows.append({"ar": ar.tokens, "spec": sp.tokens, "rounds": sp.num_rounds, "drafted": sp.num_drafted,
                     "accepted": sp.num_accepted, "accepted_per_pos": list(sp.accepted_per_position),
                     "drafted_per_pos": list(sp.drafted_per_position)})
    return rows


def compare(mine: list[dict], theirs: list[dict], max_new_tokens: int) -> list[dict]:
    """Per prompt (greedy): outputs equal, drafts equal, accepted equal (vLLM's excess allowed on a prompt that
    ended by length), τ both ways."""
    rows = []
    for m, t in zip(mine, theirs, strict=True):
        out = t["samples"][0]
        by_length = t["finish_reason"][0] == "length"
        extra = t["num_accepted_tokens"] - m["accepted"]
        rows.append({
            "outputs_equal": out == m["ar"] == m["spec"], "by_length": by_length,
            "rounds": m["rounds"], "vllm_drafts": t["num_drafts"], "drafts_equal": t["num_drafts"] == m["rounds"],
            "accepted": m["accepted"], "vllm_accepted": t["num_accepted_tokens"], "accepted_extra": extra,
            "acceptance_equal": extra == 0 or (by_length and extra > 0),
            "accepted_per_pos": m["accepted_per_pos"], "vllm_accepted_per_pos": t["accepted_per_pos"],
            "tau": 1 + m["accepted"] / m["rounds"] if m["rounds"] else None,
            "vllm_tau": 1 + t["num_accepted_tokens"] / t["num_drafts"] if t["num_drafts"] else None,
        })
    return rows


def summary(rows: list[dict]) -> dict:
    """One line of the check table: every prompt's outputs / drafts / acceptance equal, pooled τ both ways."""
    r = sum(x["rounds"] for x in rows)
    v = sum(x["vllm_drafts"] for x in rows)
    return {"outputs_equal": all(x["outputs_equal"] for x in rows),
            "acceptance_equal": all(x["drafts_equal"] and x["acceptance_equal"] for x in rows),
            "tau": 1 + sum(x["accepted"] for x in rows) / r if r else None,
            "vllm_tau": 1 + sum(x["vllm_accepted"] for x in rows) / v if v else None,
            "length_extra": sum(x["accepted_extra"] for x in rows if x["by_length"])}


def load_pair(drafter: str | os.PathLike, target: str):
    """drafttrain's side of a check: ``(model, tokenizer, drafter module, decode method, kind)`` for the saved
    drafter (or EAGLE-3 export) at ``drafter`` on ``target`` (Medusa-2: the target with its adapter merged)."""
    import torch

    from ..artifacts import drafter_type, load
    from ..config import TargetConfig
    from ..targets.load import load_target

    model, tok, _ = load_target(TargetConfig(name_or_path=str(target), dtype="float32"))
    kind = drafter_type(drafter) or "eagle3"  # None: an EAGLE-3 export
    model, d, _ = load(drafter, model, torch.device("cpu"))
    return model, tok, d.float().eval(), {"medusa2": "medusa"}.get(kind, kind), kind


def serving_spec(drafter: str | os.PathLike, target: str, work: str | os.PathLike, K: int, *, model=None,
                 tokenizer=None, dtype: str = "float32", fmt: str | None = None) -> dict:
    """Export ``drafter`` for vLLM under ``work`` (``format=hf`` for a draft model, else ``format=vllm``; an
    EAGLE-3 export is served as it is) and return the driver's run settings (``target``, ``speculative_config``).
    Medusa-2: vLLM serves the target with the adapter merged (``model``, already merged, saved under ``work``)."""
    from ..artifacts import drafter_type
    from ..export import export_drafter

    work = Path(work)
    kind = drafter_type(drafter)
    if kind is None:
        return {"target": str(target), "speculative_config": speculative_config("eagle3", drafter, K)}
    fmt = fmt or ("hf" if kind == "draft_model" else "vllm")  # DFlash: vllm (speculators) or zlab
    out = export_drafter(drafter, fmt, work / f"export-{fmt}-{dtype}", dtype=dtype, num_speculative_tokens=K,
                         overwrite=True)
    served, spec_dir = str(target), out
    if kind == "medusa2":
        from ..io import read_json
        from ..layout import HEADS_DIR, HEADS_KEY

        spec_dir = out / read_json(out / "config.json").get(HEADS_KEY, HEADS_DIR)
        served = str(work / "target-medusa2-merged")
        model.save_pretrained(served, safe_serialization=True)
        tokenizer.save_pretrained(served)
    return {"target": served, "speculative_config": speculative_config(kind, spec_dir, K)}


def first_position_rates(mine: list[dict], theirs: list[dict]) -> dict:
    """Sampling: the acceptance rate of the first draft position, pooled over prompts, both ways, with the
    normal-approximation standard error of their difference (rounds taken as independent trials)."""
    import math

    a1, n1 = sum(m["accepted_per_pos"][0] for m in mine), sum(m["drafted_per_pos"][0] for m in mine)
    a2, n2 = sum(t["accepted_per_pos"][0] for t in theirs), sum(t["num_drafts"] for t in theirs)
    p = (a1 + a2) / (n1 + n2) if n1 + n2 else 0.0
    se = math.sqrt(p * (1 - p) * (1 / max(n1, 1) + 1 / max(n2, 1)))
    return {"ours": a1 / n1 if n1 else None, "vllm": a2 / n2 if n2 else None, "n_ours": n1, "n_vllm": n2, "se": se}
