"""Conversations from datasets: ``data=hub`` (a dataset name and split, read by ``datasets.load_dataset``: the
Hub, or offline the local ``datasets`` cache) and ``data=file`` (a local ``.parquet`` / ``.arrow`` / ``.json`` /
``.jsonl`` file, a directory of them, or a ``save_to_disk`` directory). Rows are mapped by ``data.format``
(chat.FORMATS; ``auto``: detected from the columns) and validated by chat.parse_row, the parser JSONL rows go
through, so a bad row is reported as ``<path>[<split>] row <index>: what`` and ``skip_invalid`` counts it.

A ``.jsonl`` file is read line by line by chat.read_conversations (``file:line`` messages, ``dropped`` rows,
unique ids). Local files are prepared in a temporary cache and read into memory: nothing is written next to
them or into the ``datasets`` cache; hub names use the ``datasets`` cache as usual.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..io import DraftTrainError
from .chat import (Conversation, Conversations, check_nonempty, detect_format, parse_row, read_conversations,
                   warn_skipped)

__all__ = ["FILE_SUFFIXES", "read_source", "load_split", "source_label"]

# a single file's type -> the datasets builder that reads it
FILE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}
_BATCH = 1024


def source_label(path, split: str) -> str:
    """How messages name a dataset source: ``<path>[<split>]``."""
    return f"{path}[{split}]"


def read_source(path, split: str = "train", subset: str | None = None, fmt: str = "auto",
                skip_invalid: bool = False, prompts_only: bool = False, hub: bool = False) -> Conversations:
    """The validated conversations of ``split`` of ``path`` (``hub``: a hub dataset name is allowed; ``subset``:
    its configuration). ``prompts_only``: evaluation prompts (chat.parse_row)."""
    local = Path(os.path.expanduser(str(path)))
    if local.is_file() and local.suffix == ".jsonl":
        return read_conversations(local, skip_invalid=skip_invalid, prompts_only=prompts_only, fmt=fmt)
    label = source_label(path, split)
    ds = load_split(path, split, subset, hub)
    fmt = detect_format(ds.column_names, fmt, label)
    cols = [c for c in ("conversations", "messages", "instruction", "response", "id", "prompt_id", "uuid")
            if c in ds.column_names]
    skipped: list[str] = []
    out: list[Conversation] = []
    i = 0
    for batch in ds.select_columns(cols).iter(batch_size=_BATCH):
        for values in zip(*(batch[c] for c in cols)):
            where = f"{label} row {i}"
            i += 1
            try:
                messages, rid = parse_row(dict(zip(cols, values)), where, prompts_only, fmt)
            except DraftTrainError as e:
                if not skip_invalid:
                    raise
                skipped.append(str(e))
                continue
            out.append(Conversation(messages=messages, id=rid, source=where))
    check_nonempty(out, skipped, label)
    warn_skipped(skipped, label)
    return Conversations(out, skipped=skipped)


def load_split(path, split: str, subset: str | None = None, hub: bool = False):
    """One split of a dataset as a ``datasets.Dataset``; any failure of ``datasets`` is one line."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    local = Path(os.path.expanduser(str(path)))
    label = source_label(path, split)
    if not local.exists():
        if not hub:
            raise DraftTrainError(f"{path}: no such file or directory")
        return _call(label, lambda: load_dataset(str(path), subset, split=split))
    if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
        ds = _call(label, lambda: load_from_disk(str(local)))  # written by save_to_disk: read in place
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise DraftTrainError(f"{label}: no split {split!r} (splits: {', '.join(ds)}; set data.split)")
            ds = ds[split]
        return ds
    if local.is_file():
        builder = FILE_SUFFIXES.get(local.suffix)
        if builder is None:
            raise DraftTrainError(f"{path}: unsupported file type {local.suffix or '(none)'!r} (expected "
                                  f"{', '.join(FILE_SUFFIXES)}, or a directory of them)")
        base = re.sub(r"\[.*$", "", split) or "train"  # one file is every split's rows (slices apply)
        return _local(label, lambda tmp: load_dataset(builder, data_files={base: str(local)}, split=split,
                                                      cache_dir=tmp, keep_in_memory=True))
    return _local(label, lambda tmp: load_dataset(str(local), subset, split=split, cache_dir=tmp,
                                                  keep_in_memory=True))


def _local(label: str, load):
    """``load(cache_dir)`` with a temporary cache and the progress bars off (local files: nothing cached)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    bars_were_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="drafttrain-ds-") as tmp:
            return _call(label, lambda: load(tmp))
    finally:
        if not bars_were_off:
            enable_progress_bars()


def _call(label: str, load):
    """Run a ``datasets`` loader; its errors (unknown split, no data files, not on the Hub, offline, unreadable
    file) become one line naming the source."""
    try:
        return load()
    except DraftTrainError:
        raise
    except Exception as e:  # datasets raises many types (ValueError, FileNotFoundError, DatasetNotFoundError, ...)
        first = (str(e).strip().splitlines() or [""])[0]
        raise DraftTrainError(f"{label}: cannot load the dataset: {type(e).__name__}: {first}") from None
