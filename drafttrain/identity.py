"""What a target *is*, independent of the path it was reached through: the key of everything derived from it.

``target_identity(path_or_name)``:
- a built-in target (a folder with ``drafttrain_builtin.json``): ``builtin-target-<spec hash>``, the same hash
  that names its cache entry (targets/builtin.py), read from the build's record, so a copy or a symlink of it
  has the same identity;
- any other local model folder: ``sha256:<16 hex>`` over ``config.json`` and every weight file's name, size and
  content hash (a Hugging Face cache blob's file name is already its sha256; other files are hashed once and
  the result kept in ``$DRAFTTRAIN_CACHE/target-ids/``, reused while the file's size and mtime are unchanged);
- anything else (a hub name, or an identity already): the string itself.

Regenerated data, captured features and checkpoints record it and compare it, so the same cache reached through
a symlink, a moved ``DRAFTTRAIN_CACHE`` or another mount is reused, and another target is still told apart.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

__all__ = ["target_identity", "same_target"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _cache_dir() -> Path:
    from .io import cache_root

    return cache_root() / "target-ids"


def _builtin_identity(info_path: Path) -> str | None:
    try:
        info = json.loads(info_path.read_text())
        spec = dict(info["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if spec.get("kind", "code") == "code":
        spec.pop("kind", None)  # as BuiltinTargetConfig.key(): code builds keep the name they had before the field
    blob = json.dumps(spec, sort_keys=True) + str(info.get("python", ""))
    return f"builtin-target-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def _file_hash(path: Path, memo: dict) -> str:
    """sha256 of a weight file: a HF cache blob's name, else the memo's value for this size and mtime, else read."""
    real = path.resolve()
    if _HEX64.match(real.name) and real.parent.name == "blobs":
        return real.name
    st = real.stat()
    key = str(real)
    hit = memo.get(key)
    if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
        return hit[2]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    memo[key] = [st.st_size, st.st_mtime_ns, h.hexdigest()]
    return memo[key][2]


def _weights_identity(folder: Path) -> str:
    from .io import write_json

    memo_path = _cache_dir() / f"{hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]}.json"
    try:
        memo = json.loads(memo_path.read_text())
        memo = memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        memo = {}
    before = dict(memo)
    h = hashlib.sha256(b"drafttrain-target-v1\0")
    h.update((folder / "config.json").read_bytes())
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
            h.update(f"\0{p.name}\0{p.stat().st_size}\0{_file_hash(p, memo)}".encode())
    if memo != before:
        try:
            write_json(memo_path, memo)  # atomic; a cache that cannot be written only costs a re-hash
        except OSError:
            pass
    return f"sha256:{h.hexdigest()[:16]}"


def target_identity(path_or_name: str | os.PathLike | None) -> str:
    """The identity of a target given by its folder (or hub name, or an identity string): see the module doc."""
    if path_or_name is None:
        return ""
    s = str(path_or_name)
    p = Path(os.path.expanduser(s))
    if not s or not p.is_dir():
        return s
    if (p / "drafttrain_builtin.json").is_file():
        ident = _builtin_identity(p / "drafttrain_builtin.json")
        if ident:
            return ident
    if (p / "config.json").is_file():
        return _weights_identity(p)
    return str(p.resolve())


def same_target(a: str | None, b: str | None) -> bool:
    """Whether two recorded targets (paths, hub names or identities) are the same target."""
    return a == b or (bool(a) and bool(b) and target_identity(a) == target_identity(b))
