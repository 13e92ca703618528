"""``drafttrain capture capture.backend=vllm``: the hidden states come from vLLM's ``extract_hidden_states``
(the engine venv, drafttrain/engines/vllm_capture_driver.py) instead of HF forwards; the store is the same
(capture.py's plan, shards, records, index, checksums and resume; store.py describes the files).

How the states map (docs/design.md "Hidden-state taps"): vLLM layer id ``i`` is the residual stream entering
decoder layer ``i`` = HF ``hidden_states[i]`` for ``0 <= i < L``; vLLM id ``L`` is the last layer's output
*before* the final norm, while HF ``hidden_states[L]`` (and the stored ``last_hidden``, the lm_head input) is
after it. So the driver is asked for the ids ``{t : t in taps, t < L} ∪ {L}`` (ascending, no repeats: vLLM sorts
and dedups them), and here ``last_hidden = final_norm(state L)`` with the target's own norm module, a tap ``L``
is ``last_hidden``, and the taps are reassembled in the plan's order.

Flow: the shards still to write go to one driver process (vLLM loads once) as jobs, each written to
``capture.path/.vllm-work/shard-K.safetensors``; each job file is then checked (token ids equal the shard's
examples, shapes), converted into the store's shard K (written and recorded by capture.py) and deleted. An
interrupted run resumes: recorded shards are skipped, job files already written are converted without running
vLLM on them again. Checks per example: vLLM's greedy next token after the prompt is the argmax (within a
tolerance) of ``lm_head(last_hidden[-1])`` computed here, so a misattributed row, a shifted position or a target
whose logits are not ``lm_head(norm(h))`` is refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..io import DraftTrainError

WORK = ".vllm-work"


def engine_layer_ids(plan: dict, n_layers: int) -> list[int]:
    """The vLLM aux-layer ids the plan's features need (ascending, no repeats)."""
    taps = plan["taps"] if "taps" in plan["features"] else []
    return sorted({int(t) for t in taps if int(t) < n_layers} | {n_layers})


def features_from_states(states: torch.Tensor, layer_ids: Sequence[int], plan: dict, n_layers: int,
                         final_norm) -> dict[str, torch.Tensor]:
    """``states`` ``[N, len(layer_ids), H]`` (vLLM's, per token) -> the plan's features ``{name: [N, width]}``."""
    pos = {int(i): j for j, i in enumerate(layer_ids)}
    if n_layers not in pos:
        raise DraftTrainError(f"capture.backend=vllm: layer {n_layers} (the last layer's output) was not captured")
    with torch.no_grad():
        last = final_norm(states[:, pos[n_layers]])
    out = {"last_hidden": last}
    if "taps" in plan["features"]:
        missing = [int(t) for t in plan["taps"] if int(t) != n_layers and int(t) not in pos]
        if missing:
            raise DraftTrainError(f"capture.backend=vllm: tap {missing[0]} was not captured (layers {list(layer_ids)})")
        out["taps"] = torch.cat([last if int(t) == n_layers else states[:, pos[int(t)]] for t in plan["taps"]], dim=-1)
    return {name: out[name] for name in plan["features"]}


def check_next_tokens(head, last_rows: torch.Tensor, next_tokens: torch.Tensor, example_ids: Sequence[int]) -> float:
    """Refuse when vLLM's greedy token after a prompt is not (within tolerance) the argmax of
    ``lm_head(last_hidden)`` at the prompt's last position; returns the largest gap ``max logit - logit[token]``."""
    with torch.no_grad():
        logits = head(last_rows.to(head.weight.dtype)).float()
    top = logits.max(dim=-1).values
    mine = logits.gather(1, next_tokens.long().view(-1, 1)).squeeze(1)
    gap = top - mine
    # fp32: rounding only; bf16/fp16: vLLM's logits and ours round differently, a near-tie may flip
    tol = (1e-3 if head.weight.dtype == torch.float32 else 3e-2) * torch.clamp(top.abs(), min=1.0)
    bad = (gap > tol).nonzero().flatten().tolist()
    if bad:
        j = bad[0]
        raise DraftTrainError(
            f"capture.backend=vllm: example {example_ids[j]}: vLLM's next token {int(next_tokens[j])} is not the argmax "
            f"of lm_head(final_norm(vLLM's last state)) ({int(logits[j].argmax())}, logit gap {float(gap[j]):.3g}): the "
            f"captured states do not belong to this example, or this target's logits are not lm_head(norm(h)) "
            f"(use capture.backend=hf)")
    return float(gap.max()) if gap.numel() else 0.0


def read_job(path: Path, examples: Sequence[dict], rows: range, n_ids: int, hidden: int) -> dict[str, torch.Tensor]:
    """A driver job file, checked against the shard's examples (token ids, offsets, shapes)."""
    from safetensors.torch import load_file

    try:
        got = load_file(str(path))
    except Exception as e:  # noqa: BLE001 -- a damaged file: one line
        raise DraftTrainError(f"capture.backend=vllm: {path} is not readable ({str(e).splitlines()[0]}); delete it "
                              f"and rerun") from None
    lengths = [len(examples[i]["input_ids"]) for i in rows]
    ids = torch.cat([torch.as_tensor(examples[i]["input_ids"], dtype=torch.int64) for i in rows])
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    want = {"hidden_states": (int(ids.numel()), n_ids, hidden), "token_ids": (int(ids.numel()),),
            "offsets": (len(lengths) + 1,), "next_token": (len(lengths),)}
    shapes = {k: tuple(v.shape) for k, v in got.items()}
    if shapes != want:
        raise DraftTrainError(f"capture.backend=vllm: {path} holds {shapes}, expected {want}; delete it and rerun")
    if not (torch.equal(got["token_ids"].long(), ids) and torch.equal(got["offsets"].long(), offsets)):
        raise DraftTrainError(f"capture.backend=vllm: {path} holds states of other tokens than examples "
                              f"{rows.start}..{rows.stop - 1} (a capture of other data?); delete it and rerun")
    return got


def engine_dtype(model) -> str:
    dt = next(iter(p for p in model.parameters() if p.is_floating_point())).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dt]


def run_engine_driver(spec: dict, timeout: float | None = None) -> dict:
    """``vllm_capture_driver.py`` on ``spec`` in the engine venv, in one process; its JSON result (one-line
    errors)."""
    from ..engines.vllm_check import run_engine_script

    driver = Path(__file__).resolve().parent.parent / "engines" / "vllm_capture_driver.py"
    return run_engine_script(driver, spec, timeout, label="capture.backend=vllm: ",
                             env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


class VllmSource:
    """The feature source of ``run_capture`` for capture.backend=vllm. ``model``: the target's HF module with at
    least its final norm and lm_head loaded (``load_target_parts``), ``target_path``: the checkpoint vLLM serves."""

    def __init__(self, model, target_path: str, examples: list[dict], out_dir: Path, *, batch_size: int,
                 say=None, driver=run_engine_driver) -> None:
        from ..targets.load import num_layers, text_config

        self.model, self.target_path, self.examples, self.out = model, str(target_path), examples, Path(out_dir)
        self.n_layers = num_layers(model)
        self.hidden_size = int(text_config(model.config).hidden_size)
        self.batch_size, self.driver = int(batch_size), driver
        self.say = say or (lambda m: None)
        dec = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.final_norm = getattr(dec, "norm", None)
        if self.final_norm is None:
            raise DraftTrainError(f"capture.backend=vllm: {type(model).__name__} has no final norm at "
                                  f"get_decoder().norm, needed to turn vLLM's last state into the lm_head input; "
                                  f"use capture.backend=hf")
        self.head = model.get_output_embeddings()
        self.layer_ids: list[int] = []
        self.max_gap = 0.0
        self.driver_result: dict | None = None

    def job_path(self, k: int) -> Path:
        return self.out / WORK / f"shard-{k:05d}.safetensors"

    def prepare(self, plan: dict, shards: list[int]) -> None:
        self.layer_ids = engine_layer_ids(plan, self.n_layers)
        if not shards:
            return
        (self.out / WORK).mkdir(exist_ok=True)
        jobs = [{"name": str(k), "out": str(self.job_path(k)),
                 "prompts": [list(map(int, self.examples[i]["input_ids"])) for i in range(*plan["shards"][k])]}
                for k in shards]
        todo = sum(not self.job_path(k).exists() for k in shards)
        longest = max(len(p) for j in jobs for p in j["prompts"])
        self.say(f"capture: vLLM (extract_hidden_states, layers {self.layer_ids}) on {todo} of {len(shards)} shards "
                 f"still to write ({len(shards) - todo} already captured by vLLM)")
        spec = {"target": self.target_path, "dtype": engine_dtype(self.model), "layer_ids": self.layer_ids,
                "max_model_len": longest + 1, "max_num_seqs": self.batch_size, "work": str(self.out / WORK),
                "jobs": jobs}
        self.driver_result = self.driver(spec)

    def shard(self, plan: dict, k: int, rows: range, sdtype, stats: dict, bar) -> dict[int, dict[str, torch.Tensor]]:
        path = self.job_path(k)
        if not path.exists():
            raise DraftTrainError(f"capture.backend=vllm: the driver wrote no {path}")
        got = read_job(path, self.examples, rows, len(self.layer_ids), self.hidden_size)
        feats = features_from_states(got["hidden_states"].to(self.head.weight.dtype), self.layer_ids, plan,
                                     self.n_layers, self.final_norm)
        off = got["offsets"].tolist()
        self.max_gap = max(self.max_gap, check_next_tokens(
            self.head, feats["last_hidden"][[o - 1 for o in off[1:]]], got["next_token"], list(rows)))
        per_example = {}
        for j, i in enumerate(rows):
            per_example[i] = {name: feats[name][off[j]:off[j + 1]].to("cpu", sdtype) for name in plan["features"]}
            if not all(torch.isfinite(t).all() for t in per_example[i].values()):
                raise DraftTrainError(f"capture: non-finite hidden states for example {i} (target dtype overflow?)")
        bar.update(off[-1])
        ran = {j["name"]: j for j in (self.driver_result or {}).get("jobs", []) if not j.get("skipped")}
        stats["forward_seconds"] += float(ran.get(str(k), {}).get("seconds", 0.0))  # vLLM's generate of this shard
        return per_example

    def written(self, k: int) -> None:
        """Shard k is in the store (file and record): its job file is no longer needed."""
        self.job_path(k).unlink(missing_ok=True)

    def finish(self) -> None:
        import shutil

        shutil.rmtree(self.out / WORK, ignore_errors=True)
