"""Check a composed job config before anything heavy runs: ranges, choices, cross-field rules and paths.

``check_job(job, cfg)`` is called by the CLI right after Hydra composes the config (before the run directory
exists, before a model loads). The ranges and choices are declared beside the fields in
drafttrain/config.py (``num``, ``one_of``, ``matching``); the rules that tie several fields together and the
path checks are here. Every failure is one ``DraftTrainError`` line naming the key, the value and what is
allowed.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from . import config as C
from .io import DraftTrainError, looks_local

JOB_SCHEMAS = {
    "train": C.TrainJob,
    "eval": C.EvalJob,
    "bench": C.BenchJob,
    "tune": C.TuneJob,
    "build_target": C.BuildTargetJob,
    "regenerate": C.RegenerateJob,
    "capture": C.CaptureJob,
    "export": C.ExportJob,
}


def check_job(job: str, cfg: DictConfig) -> None:
    """Raise DraftTrainError (one line) for the first value of ``cfg`` that job ``job`` cannot run with."""
    check_values(job, cfg)
    check_paths(job, cfg)


def check_values(job: str, cfg: DictConfig) -> None:
    """The ranges, choices and cross-field rules (everything but the paths)."""
    check_fields(cfg, JOB_SCHEMAS[job])
    _check_rules(job, cfg)


# ------------------------------------------------------------------------------------ per-field rules


def _fmt(value) -> str:
    if isinstance(value, (ListConfig, list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flatten(value) -> list:
    if isinstance(value, (ListConfig, list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def check_fields(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    """The ranges, choices and patterns declared in drafttrain/config.py, over ``cfg`` and its sub-configs."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        if OmegaConf.is_missing(cfg, f.name):
            continue  # a mandatory value: OmegaConf names it when the job reads it
        value = cfg[f.name]
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            check_fields(value, sub, key + ".")
            continue
        if value is None:
            continue  # Optional fields: None means "the default behaviour"
        entries = _flatten(value)
        shown = f"{key}={_fmt(value)}"
        each = " (every entry)" if isinstance(value, ListConfig) else ""
        meta = f.metadata
        for x in entries:
            if "range" in meta and x not in meta["range"]:
                raise DraftTrainError(f"{shown}: must be {meta['range']}{each}")
            if "choices" in meta and x not in meta["choices"]:
                raise DraftTrainError(f"{shown}: expected one of {', '.join(meta['choices'])}{each}")
            if "pattern" in meta and not re.fullmatch(meta["pattern"][0], str(x)):
                raise DraftTrainError(f"{shown}: expected {meta['pattern'][1]}")


# -------------------------------------------------------------------------------- cross-field rules


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)


def _check_rules(job: str, cfg: DictConfig) -> None:
    if "target" in cfg and _get(cfg, "target.name_or_path") == "builtin":
        _check_builtin(cfg.target.builtin)
    if "train" in cfg:
        _check_train(cfg.train)
    if job in ("train", "capture") and cfg.eagle3.tap_layers is not None and len(cfg.eagle3.tap_layers) != 3:
        raise DraftTrainError(f"eagle3.tap_layers={_fmt(cfg.eagle3.tap_layers)}: expected exactly 3 layer indices")
    if job == "train" and cfg.method == "draft_model":
        _check_distill(cfg.distill)
    if job == "train" and cfg.method == "eagle3" and cfg.eagle3.recompute_teacher and not cfg.eagle3.compact_teacher:
        raise DraftTrainError("eagle3.recompute_teacher=true needs eagle3.compact_teacher=true (it recomputes the "
                              "compact teacher's draft-vocabulary logits)")
    if job == "train" and cfg.method == "dflash" and cfg.decode.method == "dflash" and \
            cfg.decode.num_draft_tokens > cfg.dflash.block_size - 1:
        raise DraftTrainError(f"decode.num_draft_tokens={cfg.decode.num_draft_tokens}: a DFlash block of "
                              f"dflash.block_size={cfg.dflash.block_size} drafts at most {cfg.dflash.block_size - 1} "
                              "tokens")
    if job in ("train", "capture") and cfg.get("dflash") is not None and cfg.dflash.target_layer_ids is not None \
            and len(cfg.dflash.target_layer_ids) == 0:
        raise DraftTrainError("dflash.target_layer_ids=[]: give at least one target layer (or null for the default "
                              "spread)")
    if job == "train" and cfg.capture.mode == "offline":
        from .training.method import refuse_offline

        refuse_offline(cfg)
    if "data" in cfg and job in ("train", "capture") and cfg.data.source in ("jsonl", "hub", "file") and \
            not cfg.data.path:
        raise DraftTrainError(f"data.path is required with data={cfg.data.source} (the training conversations)")
    if "data" in cfg and cfg.data.source not in ("hub", "file"):
        for key in ("subset", "eval_split"):
            if _get(cfg, f"data.{key}") is not None:
                raise DraftTrainError(f"data.{key}={_get(cfg, f'data.{key}')}: only read with data=hub or data=file")
    if "data" in cfg and cfg.data.num_eval == 0 and (cfg.data.source == "builtin" or (
            cfg.data.source == "structured" and not (cfg.data.path or cfg.data.eval_path))):
        raise DraftTrainError(f"data.num_eval=0 (every row of a prompt file) needs a file; the built-in "
                              f"data={cfg.data.source} set needs a count >= 1")
    if "data" in cfg and _get(cfg, "data.regen_answers") not in (None, 1):
        _check_answers(cfg.data)
    if job == "bench":
        _check_bench_decode(cfg.decode)
    if "decode" in cfg:
        _check_decode(cfg.decode, job)
    if job == "eval" and cfg.eval.set:
        _check_eval_set(cfg)
    if job == "tune":
        _ascending(cfg.tree_sizes, "tree_sizes")
    if job == "regenerate":
        _check_regenerate(cfg)


def _check_answers(d: DictConfig) -> None:
    shown = f"data.regen_answers={d.regen_answers}"
    if d.source != "builtin":
        raise DraftTrainError(f"{shown}: only read with data=builtin (a file's rows are its own answers)")
    if not d.regenerate or d.regen_temperature <= 0:
        raise DraftTrainError(f"{shown}: further answers are sampled, so it needs data.regenerate=true and "
                              f"data.regen_temperature > 0 (got {d.regenerate}, {_fmt(d.regen_temperature)})")


def _check_regenerate(cfg: DictConfig) -> None:
    if cfg.backend == "openai":
        for key, example in (("base_url", "http://127.0.0.1:8000/v1"), ("model", "<the served model name>")):
            if not _get(cfg, key):
                raise DraftTrainError(f"{key} is required with backend=openai (e.g. {key}={example})")
        return
    for key in ("base_url", "model"):
        if _get(cfg, key) is not None:
            raise DraftTrainError(f"{key}={_get(cfg, key)}: only used with backend=openai (the server); add "
                                  "backend=openai, or drop it to generate with target=... here")


def _check_builtin(b: DictConfig) -> None:
    if b.hidden_size % b.num_heads:
        raise DraftTrainError(f"target.builtin.hidden_size={b.hidden_size}: must be a multiple of "
                              f"target.builtin.num_heads ({b.num_heads})")
    if b.num_heads % b.num_kv_heads:
        raise DraftTrainError(f"target.builtin.num_heads={b.num_heads}: must be a multiple of "
                              f"target.builtin.num_kv_heads ({b.num_kv_heads})")
    if b.seq_len > b.max_position_embeddings:
        raise DraftTrainError(f"target.builtin.seq_len={b.seq_len}: must be <= "
                              f"target.builtin.max_position_embeddings ({b.max_position_embeddings})")


def _check_train(t: DictConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if t.batch_size % (t.micro_batch_size * world):
        procs = f" x {world} processes" if world > 1 else ""
        raise DraftTrainError(f"train.batch_size={t.batch_size}: must be a multiple of train.micro_batch_size "
                              f"({t.micro_batch_size}){procs}")
    if len(t.betas) != 2:
        raise DraftTrainError(f"train.betas={_fmt(t.betas)}: expected two numbers (beta1, beta2)")
    if t.get("overwrite") and t.resume:
        raise DraftTrainError(f"train.overwrite=true with train.resume={t.resume}: resuming continues the earlier "
                              "run, overwrite moves it aside; choose one")


def _check_eval_set(cfg: DictConfig) -> None:
    from .data.questions import HUMANEVAL

    if cfg.decode.num_prompts:
        raise DraftTrainError(f"decode.num_prompts={cfg.decode.num_prompts} with eval.set: select questions with "
                              "eval.per_category / eval.categories / eval.max_turns instead")
    spec = str(cfg.eval.set)
    p = Path(os.path.expanduser(spec))
    if spec.strip().lower() != HUMANEVAL and not (p.is_file() or (p / "question.jsonl").is_file()):
        raise DraftTrainError(f"eval.set={spec}: no such question file (expected {HUMANEVAL}, a question.jsonl in the "
                              "Spec-Bench / EAGLE format, or the folder holding one)")


def _check_distill(d: DictConfig) -> None:
    from .training.draft_model import parse_loss

    parse_loss(d.loss)
    if d.init == "from_pretrained" and not d.pretrained:
        raise DraftTrainError("distill.pretrained is required with distill.init=from_pretrained")


def _check_decode(d: DictConfig, job: str) -> None:
    if d.method != "ar" and d.num_draft_tokens < 1:
        raise DraftTrainError(f"decode.num_draft_tokens={d.num_draft_tokens}: must be >= 1 for "
                              f"decode.method={d.method} (0 drafts is plain decoding: decode.method=ar)")
    if job in ("eval", "tune") and d.method == "draft_model" and not d.draft_model:
        raise DraftTrainError("decode.draft_model is required with decode.method=draft_model")
    t = d.tree
    if t.enabled and d.method == "eagle3" and t.total_tokens > t.top_k + (t.depth - 1) * t.top_k ** 2:
        raise DraftTrainError(
            f"decode.tree.total_tokens={t.total_tokens}: must be <= top_k + (depth - 1) * top_k**2 = "
            f"{t.top_k + (t.depth - 1) * t.top_k ** 2} (the candidates one round of decode.tree.depth={t.depth}, "
            f"decode.tree.top_k={t.top_k} scores)")
    _ascending(d.buckets, "decode.buckets")
    if d.grammar is not None and str(d.grammar).lower() != "none":
        check_grammar(str(d.grammar))
    _check_batch(d)


# the decode settings `drafttrain bench` reads (drafttrain/evaluation/bench.py); its rows are `methods`, greedy, batch 1
BENCH_DECODE_FIELDS = ("num_prompts", "max_new_tokens", "warmup", "repeats", "num_draft_tokens", "pld_max_ngram",
                       "tree", "cache", "static_shapes", "buckets", "compile", "draft_model")


def _check_bench_decode(d: DictConfig) -> None:
    """``drafttrain bench`` refuses a decode setting it would ignore (one line naming it)."""
    if d.num_draft_tokens < 1:
        raise DraftTrainError(f"decode.num_draft_tokens={d.num_draft_tokens}: must be >= 1 (K of bench's draft_model "
                              "and eagle3 rows; plain decoding is its ar row)")
    default = OmegaConf.structured(C.DecodeConfig)
    for f in dataclasses.fields(C.DecodeConfig):
        if f.name in BENCH_DECODE_FIELDS or d[f.name] == default[f.name]:
            continue
        hint = "choose its rows with methods=[…]" if f.name == "method" else "its rows are greedy, batch 1"
        raise DraftTrainError(f"decode.{f.name}={_fmt(d[f.name])}: drafttrain bench does not read it ({hint}; it "
                              f"reads decode.{', decode.'.join(BENCH_DECODE_FIELDS)})")


def _check_batch(d: DictConfig) -> None:
    """``decode.batch_size > 1`` (drafttrain/decoding/batched.py): chain methods only, eager, unconstrained."""
    if d.batch_size <= 1:
        return
    off = [(d.tree.enabled, "decode.tree.enabled=true"), (d.method == "oracle", "decode.method=oracle"),
           (d.grammar is not None and str(d.grammar).lower() != "none", f"decode.grammar={d.grammar}"),
           (d.typical_acceptance and d.temperature > 0, "decode.typical_acceptance=true"),
           (d.static_shapes, "decode.static_shapes=true")]
    bad = [what for on, what in off if on]
    if bad:
        raise DraftTrainError(f"decode.batch_size={d.batch_size}: decode.batch_size>1 supports chain methods only "
                              f"(ar, pld, eagle3, medusa, draft_model, dflash), eager and unconstrained; not {', '.join(bad)}")


def _ascending(values, key: str) -> None:
    v = list(values)
    if any(b <= a for a, b in zip(v, v[1:])):
        raise DraftTrainError(f"{key}={_fmt(values)}: must be strictly increasing")


def check_grammar(spec: str, where: str = "decode.grammar") -> None:
    """Parse the grammar spec and compile its regex / JSON schema without a tokenizer (cheap), so a malformed
    one is reported, naming ``where``, before the target loads."""
    from .structured.grammar import _xgr, parse_spec, xgrammar_message

    gspec = parse_spec(spec, where)
    if gspec.kind == "json":
        return
    xgr = _xgr()
    try:
        if gspec.kind == "regex":
            xgr.Grammar.from_regex(gspec.regex)
        else:
            xgr.Grammar.from_json_schema(gspec.schema_text)
    except (RuntimeError, ValueError) as e:
        raise DraftTrainError(f"{where} ({gspec.describe()}): not a valid grammar: {xgrammar_message(e)}") from None


# ----------------------------------------------------------------------------------------------- paths


def _missing(value: str, kind: str) -> str | None:
    p = Path(os.path.expanduser(str(value)))
    if kind == "file":
        return None if p.is_file() else "not a file" if p.exists() else "no such file"
    if kind == "model" and not looks_local(value):
        return None  # a hub name: the loader resolves it (the local HF cache when offline)
    if kind in ("path", "dataset"):  # a file or a directory (dataset: or a hub name)
        return None if p.exists() or (kind == "dataset" and not looks_local(value)) else "no such file or directory"
    return None if p.is_dir() else "not a directory" if p.exists() else "no such directory"


def _path_settings(job: str, cfg: DictConfig) -> list[tuple[str, str]]:
    """``(key, kind)`` of the path-like settings this job will read; kind: model (a directory or a hub name),
    dir, file."""
    out = [("target.name_or_path", "model")] if _get(cfg, "target.name_or_path") not in (None, "builtin") else []
    if job in ("eval", "export", "bench", "tune"):
        out.append(("drafter", "dir"))
    if "data" in cfg and cfg.data.source in ("jsonl", "structured"):
        out += [("data.path", "file"), ("data.eval_path", "file")]
    if "data" in cfg and cfg.data.source in ("hub", "file"):
        kind = "dataset" if cfg.data.source == "hub" else "path"
        out += [("data.path", kind), ("data.eval_path", kind)]
    if "decode" in cfg and cfg.decode.method == "draft_model":
        out.append(("decode.draft_model", "model"))
    if job == "bench" and cfg.decode.draft_model not in (None, "builtin-small") and "draft_model" in cfg.methods:
        out.append(("decode.draft_model", "model"))
    if job == "train":
        if cfg.method == "draft_model" and cfg.distill.init == "from_pretrained":
            out.append(("distill.pretrained", "model"))
        if cfg.method in ("medusa", "medusa2"):
            out.append(("medusa.init_heads", "dir"))
        if cfg.capture.mode == "offline":
            out.append(("capture.path", "dir"))
        if cfg.train.resume != "auto":
            out.append(("train.resume", "dir"))
    if job == "regenerate":
        out.append(("input", "file"))
    return out


def check_paths(job: str, cfg: DictConfig) -> None:
    """Every local path the job will read exists (hub names stay hub names); one line naming the key."""
    for key, kind in _path_settings(job, cfg):
        value = _get(cfg, key)
        if value is None or value == "???":  # unset, or mandatory and missing (OmegaConf names it)
            continue
        why = _missing(value, kind)
        if why:
            raise DraftTrainError(f"{key}={value}: {why}")
