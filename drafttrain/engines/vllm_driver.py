"""Run vLLM's offline ``LLM`` on given prompt ids and print what it generated and its spec-decode counters.

A plain script for the engine venv (scripts/make_engine_venv.sh): it imports vLLM, never drafttrain.

    ENGINE_VENV/bin/python drafttrain/engines/vllm_driver.py SPEC.json [OUT.json]

SPEC.json: ``{"target": DIR, "speculative_config": {...} | null, "prompts": [[ids]], "max_tokens": N,
"temperature": 0.0, "seed": 0, "stop_token_ids": [ids], "dtype": "float32", "n": 1, "max_model_len": 512,
"lora": DIR | null, "patch_cpu_expand": true}`` (request i gets seed + i; ``"seed": null``: unseeded requests;
``patch_cpu_expand``: :func:`patch_cpu_expand`, on unless false). Each prompt is its own ``generate`` call, so the
counters (read from ``LLM.get_metrics()`` before and after) are per prompt. ``{"runs": [SPEC, ...]}`` serves several
engines one after another in one process. Output JSON (stdout's last line, or OUT.json): ``{"vllm": version, "load_s": s, "results": [{"samples":
[[ids] per sample], "finish_reason": [...], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_pos": [...]}]}`` (with ``runs``: ``{"vllm", "runs": [{"load_s", "results"} | {"error"}]}``).
"""
from __future__ import annotations

import json
import os
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a file: its folder (drafttrain/engines) must not shadow the vllm package

COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _settings() -> None:
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                 "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)


def counters(llm) -> dict:
    out = {v: 0 for v in COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] = int(m.value)
        elif m.name == PER_POS:
            out["accepted_per_pos"] = [int(x) for x in m.values]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    b = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return d


def _expand_kernel_fixed(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel`` (``rejection_sampler.expand_batch_to_tokens``: row i's value repeated over its
    tokens, ``replace_from`` -> ``replace_to``), written into ``output`` whatever its dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


_ORIGINAL_EXPAND = []


def patch_cpu_expand(on: bool = True) -> bool:
    """Work around vLLM-CPU 0.32's ``cpu_triton_utils._expand_kernel_impl`` (``on=False`` puts vLLM's back): it
    passes ``output`` through ``.to(torch.int64)`` (a copy for any other dtype) and never writes the result back,
    so a float tensor it expands (the per-token temperature of sampled verification) stays uninitialised memory
    and the target's logits are divided by garbage (docs/export.md, "Check an export against vLLM on a laptop"). Greedy
    requests never expand it. Takes effect for the next ``LLM`` (its worker registers the CPU kernels). True if
    the fix is in place."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return False
    if not _ORIGINAL_EXPAND:
        _ORIGINAL_EXPAND.append(cpu_triton_utils._expand_kernel_impl)
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_fixed if on else _ORIGINAL_EXPAND[0]
    return bool(on)


def make_llm(spec: dict):
    from vllm import LLM

    kw = dict(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True, seed=int(spec.get("seed") or 0),
              max_model_len=int(spec.get("max_model_len", 512)), disable_log_stats=False, max_num_seqs=4)
    if spec.get("speculative_config"):
        kw["speculative_config"] = spec["speculative_config"]
    return LLM(**kw)


def serve(spec: dict) -> dict:
    """One engine (target + speculative_config): its results per prompt."""
    import gc

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    patched = patch_cpu_expand(bool(spec.get("patch_cpu_expand", True)))
    t0 = time.perf_counter()
    llm = make_llm(spec)
    load_s = time.perf_counter() - t0
    results = []
    seed = spec.get("seed", 0)  # null: unseeded requests (vLLM's shared generator)
    for i, ids in enumerate(spec["prompts"]):
        sp = SamplingParams(temperature=float(spec.get("temperature", 0.0)), max_tokens=int(spec["max_tokens"]),
                            n=int(spec.get("n", 1)), seed=None if seed is None else int(seed) + i,
                            stop_token_ids=list(spec.get("stop_token_ids") or []), detokenize=False)
        before = counters(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
        row = delta(counters(llm), before)
        row["samples"] = [list(o.token_ids) for o in out.outputs]
        row["finish_reason"] = [o.finish_reason for o in out.outputs]
        results.append(row)
    del llm
    gc.collect()
    return {"load_s": round(load_s, 2), "patched_cpu_expand": patched, "results": results}


def run(spec: dict) -> dict:
    """``spec``: one engine's settings, or ``{"runs": [settings, ...]}`` served one after another in this
    process (vLLM is imported once); a run that fails to load reports ``{"error": line}`` and the rest go on."""
    _settings()
    t0 = time.perf_counter()
    import vllm

    out = {"vllm": vllm.__version__, "import_s": round(time.perf_counter() - t0, 2)}
    if "runs" not in spec:
        return {**out, **serve(spec)}
    out["runs"] = []
    for r in spec["runs"]:
        try:
            out["runs"].append(serve(r))
        except Exception as e:  # noqa: BLE001 -- reported per run: a drafter vLLM cannot load
            msg = f"{type(e).__name__}: {e}".splitlines()
            out["runs"].append({"error": msg[0] if msg else type(e).__name__})
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    res = run(spec)
    text = json.dumps(res)
    if len(argv) == 3:
        tmp = argv[2] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, argv[2])
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
