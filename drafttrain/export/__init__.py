"""``drafttrain export drafter=DIR format=vllm|sglang|trtllm|hf out=OUT``: a trained drafter in a serving layout.

==============  =========================================================================================
drafter         formats
==============  =========================================================================================
EAGLE-3         ``vllm``: speculators layout (``vllm serve OUT``); ``sglang``: flat
                ``LlamaForCausalLMEagle3`` layout (``--speculative-draft-model-path OUT``, one draft layer);
                ``trtllm``: TensorRT-LLM's PyTorch backend (flat config, ``midlayer.*`` tensors, plus
                ``extra_llm_api_options.yaml`` for ``trtllm-serve``). See export/eagle3.py.
Medusa-1        ``vllm``: ``model_type: medusa``, ``blocks.{h}.layers.{l}.{weight,bias}``, ``lm_heads.{h}.weight``
                (SGLang has no Medusa; TensorRT-LLM runs it only from an engine build).
Medusa-2        ``vllm``: ``heads/`` in the Medusa-1 layout, ``adapter/`` the target's LoRA adapter (peft),
                ``config.json`` pointing at both. Serve the target with the adapter merged.
DFlash          ``zlab`` (also ``sglang``, ``trtllm``): the z-lab ``DFlashDraftModel`` layout vLLM (``method: dflash``),
                SGLang (``DFLASH``) and TensorRT-LLM (``decoding_type: DFlash``; ``trtllm`` adds
                ``extra_llm_api_options.yaml``) load; ``vllm``: the speculators layout (``speculators_model_type:
                dflash``, ``aux_hidden_state_layer_ids`` = the 0-based ids + 1). See export/dflash.py.
distilled (LM)  ``hf`` (also accepted: ``vllm``, ``sglang``): a plain HF model directory (``save_pretrained``,
                safetensors) plus the tokenizer when the drafter has one; TensorRT-LLM's draft-target mode
                loads that directory too (``format=trtllm`` is refused with that hint).
==============  =========================================================================================

Every export carries a model card, ``README.md`` (export/card.py): the target, the training data and budget, the
measured τ / acceptance with the decode settings (from the run beside the drafter) and each engine's launch command.
The output directory is built under a temporary name and renamed into place; a non-empty ``out`` is refused
unless ``overwrite=true``. Every exported EAGLE-3 / Medusa directory loads back into ``drafttrain eval``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..artifacts import exported_layout
from ..io import DraftTrainError, atomic_dir, read_json, write_json, write_text
from ..layout import (ADAPTER_DIR, ADAPTER_KEY, CONFIG_NAME, DFLASH_TYPE, DRAFT_MODEL_TYPE, DRAFTER_TYPES, EAGLE3_TYPE,
                      HEADS_DIR, HEADS_KEY, MEDUSA2_TYPE, MEDUSA_TYPE, TARGET_KEY, TRTLLM_LAYOUT, TRTLLM_OPTIONS_NAME, WEIGHTS_NAME,
                      exported_dflash, saved_type)
from .card import CARD_NAME, model_card
from .eagle3 import export_dtype, write_eagle3

__all__ = ["export_drafter", "run_export", "serve_commands", "serve_hint", "FORMATS"]

FORMATS = ("vllm", "sglang", TRTLLM_LAYOUT, "hf", "zlab")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise DraftTrainError(f"out={out}: exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise DraftTrainError(f"out={out}: directory is not empty (pass overwrite=true to replace it)")


def _medusa_heads_files(src: Path, tmp: Path, dtype: torch.dtype) -> None:
    """A MedusaHeads directory in vLLM's Medusa layout (config keys vLLM reads + ours, cast tensors)."""
    from ..io import load_tensors, save_tensors

    cfg = read_json(src / CONFIG_NAME)
    if saved_type(cfg) != MEDUSA_TYPE:
        raise DraftTrainError(f"{src}/{CONFIG_NAME}: not a Medusa heads directory")
    cfg["model_type"] = "medusa"
    cfg["architectures"] = ["MedusaModel"]
    cfg["num_hidden_layers"] = int(cfg["num_layers"])  # vLLM's name (its loader renames num_layers to it too)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    sd = load_tensors(src / WEIGHTS_NAME)
    want_bias = bool(cfg.get("medusa_fc_bias", True))
    if want_bias != any(k.endswith(".bias") for k in sd):
        raise DraftTrainError(f"{src}: medusa_fc_bias={want_bias} disagrees with the tensors (vLLM would silently "
                              "skip or miss the biases)")
    write_json(tmp / CONFIG_NAME, cfg)
    save_tensors(tmp / WEIGHTS_NAME, {k: v.to(dtype) for k, v in sd.items()}, metadata={"format": "pt"})


def _export_draft_lm(src: Path, tmp: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    except (OSError, ValueError) as e:
        raise DraftTrainError(f"{src}: cannot load the draft model ({str(e).splitlines()[0]})") from None
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in os.listdir(src):  # the tokenizer (the target's), when the drafter carries it
        if name.startswith(("tokenizer", "special_tokens_map", "chat_template")) or name == "vocab.json" or \
                name == "merges.txt":
            shutil.copy2(src / name, tmp / name)


def export_drafter(drafter: str | os.PathLike, fmt: str, out: str | os.PathLike, *, overwrite: bool = False,
                   dtype: str = "bfloat16", verifier: str | None = None, num_speculative_tokens: int = 3) -> Path:
    """Export the saved drafter directory ``drafter`` to ``out`` in format ``fmt``; return ``out``."""
    src, out = Path(drafter), Path(out)
    if fmt not in FORMATS:
        raise DraftTrainError(f"format={fmt}: expected one of {', '.join(FORMATS)}")
    if not (src / CONFIG_NAME).exists():
        raise DraftTrainError(f"drafter={src}: not a saved drafter directory (no config.json)")
    if out.resolve() == src.resolve():
        raise DraftTrainError(f"out={out}: is the drafter directory itself")
    _check_out(out, overwrite)
    tdtype = export_dtype(dtype)
    kind = saved_type(read_json(src / CONFIG_NAME))
    with atomic_dir(out, overwrite=True) as tmp:
        if kind == EAGLE3_TYPE:
            from ..drafters.eagle3 import Eagle3Drafter

            d = Eagle3Drafter.from_pretrained(src)
            write_eagle3(d, fmt, tmp, dtype=dtype, verifier=verifier or d.config.target_name_or_path,
                         num_speculative_tokens=num_speculative_tokens, final_dir=out)
        elif kind == DFLASH_TYPE:
            from ..drafters.dflash import DFlashDrafter
            from .dflash import write_dflash

            d = DFlashDrafter.from_pretrained(src)
            write_dflash(d, fmt, tmp, tdtype, verifier or d.config.target_name_or_path, num_speculative_tokens)
        elif fmt == "zlab":
            raise DraftTrainError(f"format=zlab: the z-lab layout is DFlash's; drafter={src} is a {kind} drafter")
        elif kind in (MEDUSA_TYPE, MEDUSA2_TYPE):
            if fmt == TRTLLM_LAYOUT:
                raise DraftTrainError("format=trtllm: Medusa on TensorRT-LLM is engine-build only (its PyTorch "
                                      "backend has no Medusa); use format=vllm")
            if fmt != "vllm":
                raise DraftTrainError(f"format={fmt}: Medusa drafters export for vLLM only (SGLang has no Medusa)")
            if kind == MEDUSA_TYPE:
                _medusa_heads_files(src, tmp, tdtype)
            else:
                cfg = read_json(src / CONFIG_NAME)
                heads, adapter = cfg.get(HEADS_KEY, HEADS_DIR), cfg.get(ADAPTER_KEY, ADAPTER_DIR)
                (tmp / heads).mkdir()
                _medusa_heads_files(src / heads, tmp / heads, tdtype)
                if not (src / adapter / "adapter_config.json").exists():
                    raise DraftTrainError(f"{src / adapter}: no LoRA adapter (adapter_config.json) in this Medusa-2 drafter")
                shutil.copytree(src / adapter, tmp / adapter)
                write_json(tmp / CONFIG_NAME, cfg)
        elif kind == DRAFT_MODEL_TYPE:
            if fmt == TRTLLM_LAYOUT:
                raise DraftTrainError("format=trtllm: a draft model needs no TensorRT-LLM layout (its draft-target "
                                      "mode loads a plain HF directory); use format=hf")
            _export_draft_lm(src, tmp, tdtype)
        else:
            raise DraftTrainError(f"drafter={src}: unknown drafter_type {kind!r} (expected "
                                  f"{', '.join(DRAFTER_TYPES[:-1])} or {DRAFTER_TYPES[-1]})")
        target = verifier or read_json(src / CONFIG_NAME).get(TARGET_KEY)
        write_text(tmp / CARD_NAME, model_card(src, kind, fmt, dtype, target, serve_commands(tmp, shown=out)))
    return out


def _dflash_command(kind_dir, cfg: dict, engine: str) -> str:
    k = (cfg.get("block_size") or 16) - 1
    if engine == TRTLLM_LAYOUT:
        return f"trtllm-serve <target> --extra_llm_api_options {Path(kind_dir) / TRTLLM_OPTIONS_NAME}"
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model <target> --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {kind_dir} --speculative-num-draft-tokens {k + 1}")
    return (f"vllm serve <target> --attention-backend flash_attn --speculative-config '{{\"method\": \"dflash\", "
            f"\"model\": \"{kind_dir}\", \"num_speculative_tokens\": {k}}}'")


def serve_commands(kind_dir: Path, shown: Path | None = None) -> list[tuple[str, str]]:
    """(engine, launch command) for every engine that loads the export in ``kind_dir`` (its path written as
    ``shown``, default ``kind_dir``): DFlash's z-lab layout loads in vLLM and SGLang, and in TensorRT-LLM with
    the options file ``format=trtllm`` writes; a draft model in vLLM and SGLang; every other layout in one."""
    kind_dir = Path(kind_dir)
    shown = kind_dir if shown is None else Path(shown)
    cfg = read_json(kind_dir / CONFIG_NAME)
    dflash = exported_dflash(cfg)
    if dflash == "zlab":
        out = [("vLLM", _dflash_command(shown, cfg, "vllm")), ("SGLang", _dflash_command(shown, cfg, "sglang"))]
        if (kind_dir / TRTLLM_OPTIONS_NAME).exists():
            out.append(("TensorRT-LLM", _dflash_command(shown, cfg, TRTLLM_LAYOUT)))
        return out
    if dflash:
        return [("vLLM", _dflash_command(shown, cfg, "vllm"))]
    layout = exported_layout(cfg)
    if layout == "vllm":
        return [("vLLM", f"vllm serve {shown}")]
    if layout == TRTLLM_LAYOUT:
        return [("TensorRT-LLM", f"trtllm-serve <target> --extra_llm_api_options {shown / TRTLLM_OPTIONS_NAME}")]
    if layout == "sglang":
        return [("SGLang", f"python -m sglang.launch_server --model <target> --speculative-algorithm EAGLE3 "
                           f"--speculative-draft-model-path {shown} --speculative-num-steps 5 --speculative-eagle-topk 4 "
                           f"--speculative-num-draft-tokens 8")]
    if saved_type(cfg) == MEDUSA_TYPE:
        return [("vLLM", f"vllm serve <target> --speculative-config '{{\"method\": \"medusa\", \"model\": \"{shown}\", "
                         f"\"num_speculative_tokens\": {cfg.get('num_heads', 4)}}}'")]
    if saved_type(cfg) == MEDUSA2_TYPE:
        return [("vLLM", f"merge {shown}/{cfg.get(ADAPTER_KEY, ADAPTER_DIR)} into the target (peft merge_and_unload), "
                         f"then vllm serve <merged target> --speculative-config '{{\"method\": \"medusa\", \"model\": "
                         f"\"{shown}/{cfg.get(HEADS_KEY, HEADS_DIR)}\", \"num_speculative_tokens\": 4}}'")]
    return [("vLLM", f"vllm serve <target> --speculative-config '{{\"model\": \"{shown}\", \"num_speculative_tokens\": 4}}'"),
            ("SGLang", f"python -m sglang.launch_server --model <target> --speculative-algorithm STANDALONE "
                       f"--speculative-draft-model-path {shown}")]


def serve_hint(kind_dir: Path, fmt: str) -> str:
    """The launch line ``drafttrain export`` prints: the ``fmt`` engine's command for a DFlash export, every
    engine's (``serve_commands``) otherwise."""
    cfg = read_json(Path(kind_dir) / CONFIG_NAME)
    if exported_dflash(cfg):
        return _dflash_command(kind_dir, cfg, fmt if fmt in ("sglang", TRTLLM_LAYOUT) else "vllm")
    return "  |  ".join(cmd for _, cmd in serve_commands(kind_dir))


def run_export(job) -> Path:
    """``drafttrain export``: ``job`` is an ``ExportJob`` (drafttrain/config.py); ``job.drafter`` is a saved drafter
    directory (the CLI resolves a training checkpoint to its drafter first: ``training.checkpoint.drafter_dir``)."""
    out = export_drafter(job.drafter, job.format, job.out, overwrite=job.overwrite, dtype=job.dtype,
                         verifier=job.verifier, num_speculative_tokens=job.num_speculative_tokens)
    print(f"[drafttrain] exported {job.drafter} -> {out} (format={job.format}, dtype={job.dtype})", flush=True)
    print(f"[drafttrain] serve: {serve_hint(out, job.format)}", flush=True)
    return out
