"""Capture a target's hidden states with vLLM's ``extract_hidden_states`` (prompt-only prefill, max_tokens=1).

A plain script for the engine venv (scripts/make_engine_venv.sh): it imports vLLM, never drafttrain. The main
environment's side (drafttrain/capture/vllm.py) turns what it writes into the standard feature store.

    ENGINE_VENV/bin/python drafttrain/engines/vllm_capture_driver.py SPEC.json [OUT.json]

SPEC.json: ``{"target": DIR, "dtype": "float32", "layer_ids": [vLLM aux layer ids, ascending, no repeats],
"max_model_len": N, "max_num_seqs": B, "work": DIR, "jobs": [{"name": str, "prompts": [[ids]], "out": PATH}]}``.
vLLM layer id ``i`` is the residual stream entering decoder layer ``i`` (hidden + residual), which is HF
``hidden_states[i]`` for ``i < L``; id ``L`` is the last layer's output *before* the final norm.

Per job, every prompt is prefilled once (greedy, one generated token; prefix caching off, so every token is
computed) with the ``extract_hidden_states`` speculative method, whose cache-only layer keeps the requested
layers' states in the KV cache; ``vllm_hs_connector.CpuHiddenStatesConnector`` copies each finished request's
states out to ``work/requests/{req_id}.safetensors``. The job's file ``out`` (written atomically) then holds
``hidden_states`` float [N, len(layer_ids), H] (the job's prompts packed in order, no padding), ``token_ids``
int64 [N] (as vLLM saw them: checked against the prompts here, and again by the reader), ``offsets`` int64
[n+1] and ``next_token`` int64 [n] (the greedy token vLLM sampled after each prompt). A job whose ``out``
exists is skipped (resume). Output JSON (stdout's last line, or OUT.json): ``{"vllm": version, "load_s": s,
"jobs": [{"name", "tokens", "seconds", "skipped"}]}``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path.pop(0)  # run as a file: its folder (drafttrain/engines) must not come before the vllm package
sys.path.append(_HERE)  # last: only for vllm_hs_connector, which vLLM imports by module path
CONNECTOR_MODULE, CONNECTOR_CLASS = "vllm_hs_connector", "CpuHiddenStatesConnector"


def _settings() -> None:
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                 "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                 "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)


def make_llm(spec: dict, requests_dir: str):
    from vllm import LLM

    ids = [int(i) for i in spec["layer_ids"]]
    if ids != sorted(set(ids)):
        raise ValueError(f"layer_ids={ids}: must be ascending without repeats (vLLM sorts and dedups them)")
    max_len = int(spec["max_model_len"])
    return LLM(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True, seed=0,
               max_model_len=max_len, max_num_seqs=int(spec.get("max_num_seqs", 8)),
               max_num_batched_tokens=max(max_len, int(spec.get("max_num_batched_tokens", 2048))),
               enable_prefix_caching=False, disable_log_stats=True,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
               kv_transfer_config={"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                                   "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": requests_dir,
                                                                 "use_synchronization_lock": False}})


def _wait_for(llm, paths: list[str], timeout: float = 60.0) -> None:
    """The connector writes a request's file one engine step after the request finished; step until all exist."""
    t0 = time.time()
    while not all(os.path.exists(p) for p in paths):
        if time.time() - t0 > timeout:
            missing = [p for p in paths if not os.path.exists(p)]
            raise RuntimeError(f"vLLM wrote no hidden states for {len(missing)} requests (e.g. {missing[0]})")
        llm.llm_engine.step()  # the engine core schedules the pending saves even with no request running


def capture_job(llm, job: dict, n_layers: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    prompts = [list(map(int, p)) for p in job["prompts"]]
    sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
    if any(p is None for p in paths):
        raise RuntimeError("vLLM returned no hidden_states_path (is the extract_hidden_states connector active?)")
    _wait_for(llm, paths)
    states, tokens, nxt = [], [], []
    for p, o, ids in zip(paths, outs, prompts):
        got = load_file(p)
        hs, tid = got["hidden_states"], got["token_ids"].long()
        if tid.tolist() != ids or tuple(hs.shape) != (len(ids), n_layers, hs.shape[-1]):
            raise RuntimeError(f"request {o.request_id}: hidden states for tokens {tid.tolist()[:8]}… shape "
                               f"{tuple(hs.shape)}, expected the prompt {ids[:8]}… ({len(ids)} tokens, {n_layers} layers)")
        states.append(hs)
        tokens.append(tid)
        nxt.append(int(o.outputs[0].token_ids[0]))
        os.remove(p)
    offsets = torch.zeros(len(prompts) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(p) for p in prompts], dtype=torch.int64), 0)
    tmp = job["out"] + ".tmp"
    save_file({"hidden_states": torch.cat(states).contiguous(), "token_ids": torch.cat(tokens).contiguous(),
               "offsets": offsets, "next_token": torch.tensor(nxt, dtype=torch.int64)}, tmp)
    os.replace(tmp, job["out"])
    return {"name": job["name"], "tokens": int(offsets[-1]), "seconds": round(time.perf_counter() - t0, 3),
            "skipped": False}


def run(spec: dict) -> dict:
    _settings()
    t0 = time.perf_counter()
    import vllm

    out = {"vllm": vllm.__version__, "import_s": round(time.perf_counter() - t0, 2), "jobs": []}
    todo = [j for j in spec["jobs"] if not os.path.exists(j["out"])]
    out["jobs"] = [{"name": j["name"], "skipped": True} for j in spec["jobs"] if os.path.exists(j["out"])]
    if not todo:
        return out
    requests_dir = os.path.join(spec["work"], "requests")
    shutil.rmtree(requests_dir, ignore_errors=True)  # leftovers of an interrupted run (request ids restart)
    os.makedirs(requests_dir)
    t1 = time.perf_counter()
    llm = make_llm(spec, requests_dir)
    out["load_s"] = round(time.perf_counter() - t1, 2)
    for job in todo:
        out["jobs"].append(capture_job(llm, job, len(spec["layer_ids"])))
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    text = json.dumps(run(spec))
    if len(argv) == 3:
        tmp = argv[2] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, argv[2])
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
