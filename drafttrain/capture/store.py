"""The offline feature store: sharded safetensors files plus an index, written by ``drafttrain capture``.

Layout of a capture directory::

    plan.json                  what is captured (format version, features and widths, storage dtype, taps,
                               target, data fingerprint) and the shard plan: shard k = examples [start, end)
    shard-00000.safetensors    packed tokens of the shard's examples (no padding):
                                 input_ids   int32 [N]      loss_mask uint8 [N]
                                 offsets     int64 [n+1]    example_ids int64 [n]   (example j = rows offsets[j]:offsets[j+1])
                                 taps        dtype [N, 3H]  (EAGLE-3: the three target taps, concatenated in tap order)
                                 last_hidden dtype [N, H]   (the input of the target's lm_head: post final norm)
    shard-00000.json           written after its shard: bytes, sha256, token/example counts, tensor shapes/dtypes
    index.json                 written once every shard is done: plan + every shard's record + totals

A shard exists under its final name only when complete (atomic write); its ``.json`` record is what marks
it done, so an interrupted capture resumes by skipping recorded shards (after checking them) and redoing
the rest; shards are numbered by the plan, so nothing is duplicated. Shard k belongs to rank ``k % world``.

Teacher logits are not stored: training recomputes them with the target's ``lm_head`` from
``last_hidden`` (SpecForge does the same). Storage per token for EAGLE-3 in bf16: 4·H values = 8·H bytes,
plus 5 bytes of ids and mask.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..io import DraftTrainError, atomic_path, read_json, write_json

FORMAT_VERSION = 1
PLAN = "plan.json"
INDEX = "index.json"

STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
                torch.int64: "I64", torch.uint8: "U8"}
VERIFY_MODES = ("lazy", "full", "size")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def record_name(k: int) -> str:
    return f"shard-{k:05d}.json"


def store_dtype(name: str) -> torch.dtype:
    if name not in STORE_DTYPES:
        raise DraftTrainError(f"capture.dtype={name}: expected one of {', '.join(STORE_DTYPES)}")
    return STORE_DTYPES[name]


def bytes_per_token(widths: dict[str, int], dtype: torch.dtype) -> int:
    """Stored bytes per token: the features plus input_ids (int32) and loss_mask (uint8)."""
    return sum(widths.values()) * dtype.itemsize + 4 + 1


def plan_shards(lengths: Sequence[int], tokens_per_shard: int) -> list[tuple[int, int]]:
    """Split examples 0..n-1 (in order) into contiguous ranges of at most ``tokens_per_shard`` tokens (at
    least one example each). Deterministic in the lengths, so a resumed capture finds the same shards."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and acc + n > tokens_per_shard:
            out.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def data_fingerprint(examples: Iterable[dict]) -> str:
    """sha256 over every example's input_ids and loss_mask: identifies the data a capture was made from."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(torch.as_tensor(ex["input_ids"], dtype=torch.int32).numpy().tobytes())
        h.update(torch.as_tensor(ex["loss_mask"], dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def pack_shard(example_ids: Sequence[int], examples: Sequence[dict], feats: dict[str, list[torch.Tensor]],
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of one shard. ``feats[name][j]``: ``[len_j, width]`` of example ``example_ids[j]``."""
    lengths = [len(ex["input_ids"]) for ex in examples]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    out = {
        "input_ids": torch.cat([torch.as_tensor(ex["input_ids"], dtype=torch.int32) for ex in examples]),
        "loss_mask": torch.cat([torch.as_tensor(ex["loss_mask"], dtype=torch.uint8) for ex in examples]),
        "offsets": offsets,
        "example_ids": torch.as_tensor(list(example_ids), dtype=torch.int64),
    }
    for name, rows in feats.items():
        out[name] = torch.cat([r.to("cpu", dtype) for r in rows]).contiguous()
    return out


def write_shard(directory: Path, k: int, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                rank: int = 0) -> dict:
    """Write shard k atomically, then its record (``rank``: the process that captured it); return the record."""
    from safetensors.torch import save

    # safetensors writes its metadata map in hash order, which changes from process to process; one key
    # (a JSON string with sorted keys) makes the bytes, and so the sha256, a function of the content only
    blob = save(tensors, metadata={"drafttrain_capture": json.dumps(meta, sort_keys=True)})
    digest = hashlib.sha256(blob).hexdigest()
    path = directory / shard_name(k)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    n = int(tensors["example_ids"].numel())
    record = {
        "shard": k,
        "rank": int(rank),
        "file": shard_name(k),
        "bytes": len(blob),
        "sha256": digest,
        "examples": n,
        "first_example": int(tensors["example_ids"][0]) if n else None,
        "tokens": int(tensors["input_ids"].numel()),
        "tensors": {name: {"shape": list(t.shape), "dtype": _DTYPE_NAMES[t.dtype]} for name, t in tensors.items()},
    }
    write_json(directory / record_name(k), record)
    return record


def expected_tensors(plan: dict, k: int, tokens: int) -> dict[str, dict]:
    """The tensor shapes and dtypes shard k must have according to the plan (``tokens`` from its record)."""
    start, end = plan["shards"][k]
    n = end - start
    out = {
        "input_ids": {"shape": [tokens], "dtype": "I32"},
        "loss_mask": {"shape": [tokens], "dtype": "U8"},
        "offsets": {"shape": [n + 1], "dtype": "I64"},
        "example_ids": {"shape": [n], "dtype": "I64"},
    }
    dt = _DTYPE_NAMES[store_dtype(plan["dtype"])]
    for name, width in plan["features"].items():
        out[name] = {"shape": [tokens, int(width)], "dtype": dt}
    return out


def check_shard(directory: Path, plan: dict, record: dict, checksum: bool) -> None:
    """Refuse shard ``record['shard']`` if its file is missing, of the wrong size, its tensors' names,
    shapes or dtypes differ from the plan, or (``checksum``) its sha256 differs from the record."""
    from safetensors import safe_open

    k = int(record["shard"])
    path = directory / shard_name(k)
    where = f"capture.path={directory}: shard {path.name}"
    if not path.exists():
        raise DraftTrainError(f"{where} is missing (listed in the index)")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise DraftTrainError(f"{where} has {size} bytes, its record says {record['bytes']} (truncated or replaced?)")
    start, end = plan["shards"][k]
    if record.get("examples") != end - start:
        raise DraftTrainError(f"{where}: record lists {record.get('examples')} examples, the plan {end - start}")
    want = expected_tensors(plan, k, int(record["tokens"]))
    try:
        with safe_open(str(path), framework="pt") as f:
            got = {name: {"shape": list(f.get_slice(name).get_shape()), "dtype": f.get_slice(name).get_dtype()}
                   for name in f.keys()}
    except Exception as e:  # a damaged header
        raise DraftTrainError(f"{where} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if got != want:
        bad = sorted(set(got) ^ set(want)) or [n for n in want if got[n] != want[n]]
        raise DraftTrainError(f"{where} has the wrong tensors/shapes/dtypes ({', '.join(bad)}): expected "
                              f"{ {n: want[n] for n in bad if n in want} }, found { {n: got.get(n) for n in bad} }")
    if checksum:
        digest = sha256_file(path)
        if digest != record["sha256"]:
            raise DraftTrainError(f"{where} fails its checksum (sha256 {digest[:12]}…, recorded "
                                  f"{record['sha256'][:12]}…); delete it and its .json and rerun capture")


def read_record(directory: Path, k: int) -> dict | None:
    p = directory / record_name(k)
    return read_json(p) if p.exists() else None


# ------------------------------------------------------------------------------------------------ reader
@dataclass
class _Loc:
    shard: int
    row: int  # position of the example inside its shard


class FeatureStore:
    """Read-only view of a finished capture directory (``index.json`` present).

    ``examples()`` gives the tokenised examples (input_ids, loss_mask) in capture order, so example i of the
    store is example i of the data it was captured from. ``batch(indices, length, names)`` gives zero-padded
    feature tensors ``[B, length, width]``. Every shard's size and tensor shapes/dtypes are checked when the
    store is opened; checksums (sha256) of all shards up front with ``verify="full"``, or of each shard the
    first time it is read with ``verify="lazy"`` (the default), or never with ``verify="size"``.
    """

    def __init__(self, path: str | os.PathLike, verify: str = "lazy") -> None:
        if verify not in VERIFY_MODES:
            raise DraftTrainError(f"capture.verify={verify}: expected one of {', '.join(VERIFY_MODES)}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise DraftTrainError(f"capture.path={self.path}: no such directory (run `drafttrain capture` first)")
        if not (self.path / INDEX).exists():
            hint = " (the capture is incomplete: rerun the same `drafttrain capture` command to finish it)" \
                if (self.path / PLAN).exists() else ""
            raise DraftTrainError(f"capture.path={self.path}: no {INDEX}{hint}")
        self.index = read_json(self.path / INDEX)
        if self.index.get("format_version") != FORMAT_VERSION:
            raise DraftTrainError(f"capture.path={self.path}: format_version {self.index.get('format_version')} "
                                  f"(this drafttrain reads {FORMAT_VERSION})")
        self.plan = self.index["plan"]
        self.records = self.index["shards"]
        if len(self.records) != len(self.plan["shards"]):
            raise DraftTrainError(f"capture.path={self.path}: index lists {len(self.records)} shards, plan "
                                  f"{len(self.plan['shards'])}")
        self.verify = verify
        for rec in self.records:
            check_shard(self.path, self.plan, rec, checksum=verify == "full")
        self._verified = {int(r["shard"]) for r in self.records} if verify != "lazy" else set()
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self.locs: list[_Loc] = []
        for k, (start, end) in enumerate(self.plan["shards"]):
            self.locs.extend(_Loc(k, j) for j in range(end - start))
        self.dtype = store_dtype(self.plan["dtype"])

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> dict:
        return self.plan

    @property
    def features(self) -> dict[str, int]:
        return dict(self.plan["features"])

    def __len__(self) -> int:
        return len(self.locs)

    @property
    def num_tokens(self) -> int:
        return int(self.index["tokens"])

    # ------------------------------------------------------------------ access
    def _open(self, k: int):
        if k not in self._verified:
            check_shard(self.path, self.plan, self.records[k], checksum=True)
            self._verified.add(k)
        if k not in self._handles:
            from safetensors import safe_open

            h = safe_open(str(self.path / shard_name(k)), framework="pt")
            self._handles[k] = h
            self._offsets[k] = h.get_tensor("offsets")
        return self._handles[k]

    def examples(self) -> list[dict]:
        """All examples as ``{"input_ids": list[int], "loss_mask": list[int]}``, in capture order."""
        out: list[dict] = []
        for k in range(len(self.records)):
            h = self._open(k)
            ids, mask, off = h.get_tensor("input_ids"), h.get_tensor("loss_mask"), self._offsets[k]
            ex_ids = h.get_tensor("example_ids")
            start = self.plan["shards"][k][0]
            if ex_ids.tolist() != list(range(start, start + ex_ids.numel())):
                raise DraftTrainError(f"capture.path={self.path}: shard {shard_name(k)} holds examples out of plan order")
            for j in range(off.numel() - 1):
                a, b = int(off[j]), int(off[j + 1])
                out.append({"input_ids": ids[a:b].long().tolist(), "loss_mask": mask[a:b].long().tolist()})
        return out

    def feature(self, i: int, name: str) -> torch.Tensor:
        """``[len_i, width]`` of example i (storage dtype)."""
        loc = self.locs[i]
        h = self._open(loc.shard)
        off = self._offsets[loc.shard]
        return h.get_slice(name)[int(off[loc.row]) : int(off[loc.row + 1])]

    def batch(self, indices: Sequence[int], length: int, names: Sequence[str] | None = None,
              device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Right-padded ``[B, length, width]`` features of examples ``indices`` (the layout of ``collate``)."""
        names = list(names or self.features)
        out = {}
        for name in names:
            if name not in self.plan["features"]:
                raise DraftTrainError(f"capture.path={self.path}: has no feature {name!r} (it holds "
                                      f"{', '.join(self.plan['features'])}); recapture with the right method")
            width = int(self.plan["features"][name])
            t = torch.zeros(len(indices), length, width, dtype=self.dtype)
            for b, i in enumerate(indices):
                f = self.feature(int(i), name)
                n = min(length, f.shape[0])
                t[b, :n] = f[:n]
            out[name] = t.to(device)
        return out
