"""Atomic file and directory writes, and safe (pickle-free) loading.

Everything the toolkit writes under a final name goes through here: write to a temporary sibling, flush,
then ``os.replace``. A crash leaves either the old file or the new one, never half of one.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file


class DraftTrainError(ValueError):
    """An error caused by user input or state; the CLI prints its message on one line and exits 2.

    A ValueError, so library callers that catch ValueError for a bad argument keep working."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# a write that fails for want of room: one line naming the file (what was there before is kept)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullError(DraftTrainError):
    """A write failed for want of room (ENOSPC, EDQUOT, EFBIG); ``why`` is the system's reason."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why


def _disk_full(path: Path, why: str, inner: str = "") -> DiskFullError:
    return DiskFullError(f"{path}: cannot write it{f' ({inner})' if inner else ''}: {why}; the previous "
                         f"{path.name}, if any, is unchanged — free space and rerun", why)


def _reason(e: OSError) -> str:
    return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the same directory; on success it is renamed onto ``path``. A full disk (or
    quota) while writing is one DraftTrainError naming ``path``; the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        if e.errno in _FULL:
            raise _disk_full(path, _reason(e)) from None
        raise
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        if e.errno in _FULL:
            raise _disk_full(path, _reason(e)) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write a matplotlib figure to ``path`` as a PNG, atomically, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DraftTrainError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise DraftTrainError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def load_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a missing, truncated or corrupted file is one DraftTrainError."""
    path = Path(path)
    if not path.exists():
        raise DraftTrainError(f"{path}: file not found (only safetensors weights are loaded)")
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftTrainError(f"{path}: cannot read safetensors file ({e})") from None


def read_drafter_config(directory: str | os.PathLike, config_name: str, drafter_type: str) -> dict:
    """``directory/config_name`` of a saved drafter, checked to be a JSON object of ``drafter_type``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DraftTrainError(f"{directory}: not a directory")
    raw = read_json(directory / config_name)
    if not isinstance(raw, dict):
        raise DraftTrainError(f"{directory / config_name}: expected a JSON object")
    if raw.get("drafter_type") != drafter_type:
        raise DraftTrainError(f"{directory / config_name}: drafter_type is {raw.get('drafter_type')!r}, "
                              f"expected {drafter_type!r}")
    return raw


def check_state_dict(where: str | os.PathLike, expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor],
                     against: str = "config.json") -> None:
    """Refuse weights whose names or shapes differ from the module built from its config (one line)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        more = lambda xs: f"{xs[:5]}{'...' if len(xs) > 5 else ''}"  # noqa: E731
        raise DraftTrainError(f"{where}: does not match {against} (missing: {more(missing)}; "
                              f"unexpected: {more(unexpected)})")
    bad = [f"{k} {tuple(found[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
           if found[k].shape != v.shape]
    if bad:
        raise DraftTrainError(f"{where}: shape mismatch vs {against}: {'; '.join(bad[:5])}")


def torch_load_safe(path: str | os.PathLike) -> Any:
    """Load a torch file without unpickling arbitrary objects (``weights_only=True``)."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Build a directory under a temporary name, then swap it in as ``path``.

    If ``path`` exists and ``overwrite`` is False this raises before anything is written. When it is
    replaced, the old directory is kept until the new one is in place.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise DraftTrainError(f"{path}: already exists; refusing to overwrite")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        try:
            yield tmp
        except DiskFullError as e:  # a file inside: name this directory, the one the user knows
            raise _disk_full(path, e.why, "while writing its files") from None
        except OSError as e:  # a writer that does not go through atomic_path (torch.save, save_pretrained)
            if e.errno in _FULL:
                raise _disk_full(path, _reason(e)) from None
            raise
        _fsync_dir(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ paths
def cache_root() -> Path:
    """drafttrain's cache (built-in targets, regenerated data): ``$DRAFTTRAIN_CACHE`` or ``~/.cache/drafttrain``."""
    return Path(os.environ.get("DRAFTTRAIN_CACHE", Path.home() / ".cache" / "drafttrain"))


def looks_local(value: str) -> bool:
    """A model name that must be a local directory: it exists, or is written as a path (``./x``, ``/x``,
    ``~/x``, ``a/b/c``, a backslash). ``org/name`` that does not exist is a hub name."""
    v = str(value)
    return (Path(os.path.expanduser(v)).exists() or v.startswith((".", "/", "~")) or "\\" in v
            or v.count("/") >= 2)
