"""Regenerate through an OpenAI-compatible server (``drafttrain regenerate backend=openai``): vLLM, SGLang,
``transformers serve`` or any ``/v1/chat/completions`` endpoint serves the target instead of HF ``generate`` here.

Each conversation is regenerated turn by turn on the model's own history: the request of assistant turn r is the
conversation so far (earlier turns as regenerated, then the next user turn), the answer replaces the input's
turn r. ``concurrency`` conversations are in flight at once (threads; one request per conversation at a time).
Rows are written in input order (a finished row waits for the rows before it), to the same output and
``<out>.meta.json`` as the HF path (:func:`drafttrain.data.regenerate.resumable_output`), so a rerun continues by
row id and a rerun with other settings is refused; the file is the same JSONL shape and trains the same way.

Requests carry only plain OpenAI fields (``model``, ``messages``, ``max_tokens``, ``temperature``, ``top_p``,
``seed``): ``transformers serve`` rejects unknown ones (HTTP 422). The seed of a request is derived from ``seed``,
the row's index and the turn, so a resumed run asks exactly what an uninterrupted one would (servers that honour
a per-request seed, like vLLM, then sample the same answers; ``transformers serve`` seeds its one global RNG per
request, so with ``concurrency > 1`` its sampled answers depend on the arrival order). ``finish_reason ==
"length"`` is a truncated turn (counted, and ``drop_truncated`` acts on it, as in the HF path); the tokens
counted are the server's ``usage.completion_tokens``.

Failures: connection errors, timeouts, HTTP 5xx (and 408 / 429, the "try again" answers) are retried ``retries``
times after ``retry_backoff * 2**k`` seconds (capped at 60 s); then, like any other HTTP 4xx at once (no retry),
the run stops with one line naming the URL and the server's message, and the rows written so far stay (a rerun
continues after them). ``base_url`` is recorded in the meta file but not checked on resume: the same model may be
served at another address after a restart (``model`` and the sampling settings are checked).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..io import DraftTrainError
from .chat import Conversation
from .regenerate import (
    _as_conversations, _chunk_rows, _take_answers, new_state, new_stats, next_turn, read_input, resumable_output,
)

__all__ = ["ServerSettings", "regenerate_with_server", "regenerate_file_with_server", "backoff_delay"]

REQUEST_FIELDS = ("model", "messages", "max_tokens", "temperature", "top_p", "seed")
RETRY_STATUS = frozenset({408, 429})  # besides every 5xx
MAX_BACKOFF = 60.0


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Where the target is served and how every turn is generated."""

    base_url: str  # the API root, e.g. http://127.0.0.1:8000/v1 (requests go to {base_url}/chat/completions)
    model: str  # the served model name (the request's `model` field)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    drop_truncated: bool = False
    concurrency: int = 16
    retries: int = 5
    retry_backoff: float = 1.0
    timeout: float = 600.0  # seconds per request

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def meta(self) -> dict:
        """What ``<out>.meta.json`` records (``backend``, ``model`` and the sampling settings are checked on resume)."""
        return {"backend": "openai", "base_url": self.base_url, "model": self.model,
                "max_new_tokens": int(self.max_new_tokens), "temperature": float(self.temperature),
                "top_p": float(self.top_p), "seed": int(self.seed), "drop_truncated": bool(self.drop_truncated),
                "concurrency": int(self.concurrency)}


def backoff_delay(attempt: int, base: float) -> float:
    """Seconds to wait before retry ``attempt + 1`` (attempt 0 = the first failure): ``base * 2**attempt``, capped."""
    return min(MAX_BACKOFF, base * 2.0 ** attempt)


def request_seed(seed: int, row: int, turn: int) -> int:
    """The seed of one request: fixed by (seed, row index, turn), so a resumed run sends the same requests."""
    return (seed * 1_000_003 + row * 1_009 + turn) % 2**31


class _Stopped(Exception):
    """The run is stopping (another request failed, or the user interrupted): no further requests."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def server_message(response) -> str:
    """The server's own words from an error response: OpenAI / vLLM ``{"error": {"message"}}``, FastAPI
    (``transformers serve``) ``{"detail": ...}``, ``{"error": "..."}`` / ``{"message": ...}``, else the body."""
    try:
        body = response.json()
    except ValueError:
        return _one_line(response.text) or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(err["message"])
        for value in (err, body.get("detail"), body.get("message")):
            if isinstance(value, str) and value:
                return _one_line(value)
            if isinstance(value, list) and value:  # FastAPI validation errors
                return _one_line("; ".join(str(v.get("msg", v)) if isinstance(v, dict) else str(v) for v in value))
    return _one_line(json.dumps(body))


def _parse_completion(response, url: str, where: str) -> tuple[str, int, bool]:
    """(answer text, completion tokens, finished: not stopped by ``max_tokens``) of a chat completion."""
    try:
        body = response.json()
        choice = body["choices"][0]
        text = choice["message"].get("content") or ""
        finish = choice.get("finish_reason")
        usage = body.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise DraftTrainError(f"{url}: the answer for {where} is not a chat completion "
                              f"({_one_line(response.text, 200)!r})") from None
    return str(text), tokens, finish != "length"


class _Client:
    """One HTTP client shared by the worker threads; ``complete`` retries what is worth retrying."""

    def __init__(self, s: ServerSettings, stop: threading.Event):
        import httpx

        self.s, self.stop, self.httpx = s, stop, httpx
        self.http = httpx.Client(timeout=httpx.Timeout(s.timeout, connect=min(30.0, s.timeout)),
                                 limits=httpx.Limits(max_connections=s.concurrency,
                                                     max_keepalive_connections=s.concurrency))

    def close(self) -> None:
        self.http.close()

    def body(self, messages: list[dict], seed: int) -> dict:
        s = self.s
        return {"model": s.model, "messages": messages, "max_tokens": int(s.max_new_tokens),
                "temperature": float(s.temperature), "top_p": float(s.top_p), "seed": int(seed)}

    def complete(self, messages: list[dict], seed: int, where: str) -> tuple[str, int, bool]:
        s, url, body = self.s, self.s.url, self.body(messages, seed)
        why, hint = "", ""
        for attempt in range(s.retries + 1):
            if attempt and self.stop.wait(backoff_delay(attempt - 1, s.retry_backoff)):
                raise _Stopped
            if self.stop.is_set():
                raise _Stopped
            try:
                r = self.http.post(url, json=body)
            except self.httpx.TransportError as e:  # refused, reset, timed out, dropped mid-answer
                why = f"{type(e).__name__}: {_one_line(e) or 'no detail'}"
                hint = f"; is the server running at base_url={s.base_url}?"
                continue
            if r.status_code < 400:
                return _parse_completion(r, url, where)
            why, hint = f"HTTP {r.status_code}: {server_message(r)}", ""
            if r.status_code < 500 and r.status_code not in RETRY_STATUS:
                raise DraftTrainError(f"{url}: the server refused the request for {where} ({why}); model={s.model}")
        raise DraftTrainError(f"{url}: no answer for {where} after {s.retries + 1} attempts (last: {why}){hint}")


class _Run:
    """The state the worker threads share: the client, the stop flag and the first failure."""

    def __init__(self, s: ServerSettings):
        self.s = s
        self.stop = threading.Event()
        self.client = _Client(s, self.stop)
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def fail(self, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = e
        self.stop.set()

    def conversation(self, conv: Conversation, i: int) -> tuple[dict, dict]:
        """Regenerate one conversation turn by turn (each request sees the model's earlier answers); its state
        (regenerate.py's) and its turn counts."""
        try:
            state, counts = new_state(conv), {"turns": 0, "new_tokens": 0, "truncated_turns": 0}
            turn = 0
            while next_turn(state):
                answer = self.client.complete(list(state["messages"]), request_seed(self.s.seed, i, turn), conv.where)
                _take_answers(self.s, {i: state}, [i], [answer], {i}, counts)
                turn += 1
            return state, counts
        except _Stopped:
            raise
        except BaseException as e:
            self.fail(e)
            raise


class _Progress:
    """rows/s (tqdm's rate) and the server's completion tokens/s."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.tokens, self.t0 = None, 0, time.time()
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="regenerate", unit="row", mininterval=1.0)

    def update(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(1e-9, time.time() - self.t0)
            self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


WINDOW = 8  # conversations submitted ahead of the next row to write, per request in flight (bounds the memory)


def _write_in_order(run: _Run, convs, todo: list[int], write, stats: dict, progress: _Progress, on_row) -> int:
    """Regenerate the conversations ``todo`` on ``concurrency`` threads, writing the rows in input order (at most
    ``WINDOW * concurrency`` submitted ahead of the next row to write); the number of rows written."""
    written, ahead, queue = 0, WINDOW * run.s.concurrency, iter(todo)
    pool = ThreadPoolExecutor(max_workers=run.s.concurrency, thread_name_prefix="regenerate")
    pending: collections.deque = collections.deque()
    try:
        while True:
            for i in itertools.islice(queue, max(0, ahead - len(pending))):
                pending.append((i, pool.submit(run.conversation, convs[i], i)))
            if not pending:
                return written
            i, fut = pending.popleft()
            try:
                state, counts = fut.result()
            except _Stopped:
                raise run.error if run.error is not None else _Stopped() from None
            for k in counts:
                stats[k] += counts[k]
            for _, row in _chunk_rows(convs, [i], {i: state}, {i}, stats):
                write(row)
                written += 1
                if on_row is not None:
                    on_row(i, row)
            progress.update(counts["new_tokens"])
    except BaseException as e:
        run.fail(e)
        e.written = written  # type: ignore[attr-defined]
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def regenerate_with_server(
    settings: ServerSettings, convs: Sequence[Conversation], out_path, progress: bool = True,
    wait_for_lock: bool = False, on_row: Callable[[int, dict], None] | None = None,
) -> dict[str, Any]:
    """Regenerate ``convs`` through the server into ``out_path`` (append-only, resumable; see the module
    docstring). ``on_row(index, row)`` is called after each row is written. Stats as
    :func:`drafttrain.data.regenerate.regenerate_to_jsonl` (rows, turns, truncated_*, new_tokens = the server's
    completion tokens, seconds, already_done, total)."""
    _check_settings(settings)
    convs = _as_conversations(convs)
    stats = new_stats(settings.max_new_tokens, settings.drop_truncated)
    t0 = time.time()
    with resumable_output(out_path, convs, settings.meta(), wait_for_lock) as (done, write):
        todo = [i for i in range(len(convs)) if i not in done]
        if todo:
            run, bar = _Run(settings), _Progress(len(todo), progress)
            try:
                _write_in_order(run, convs, todo, write, stats, bar, on_row)
            except DraftTrainError as e:
                n = getattr(e, "written", 0)
                raise DraftTrainError(f"{e} — {n} new rows were written ({len(done) + n} of {len(convs)} in "
                                      f"{out_path}); rerun the same command to continue") from None
            finally:
                bar.close()
                run.client.close()
    stats["seconds"] = round(time.time() - t0, 2)
    stats["already_done"] = len(done)
    stats["total"] = len(convs)
    return stats


def _check_settings(s: ServerSettings) -> None:
    if not str(s.base_url).startswith(("http://", "https://")):
        raise DraftTrainError(f"base_url={s.base_url}: expected an http:// or https:// URL (e.g. "
                              "http://127.0.0.1:8000/v1)")
    if not s.model:
        raise DraftTrainError("model: the served model name is required with backend=openai")
    for key, value, ok in (("max_new_tokens", s.max_new_tokens, s.max_new_tokens >= 1),
                           ("temperature", s.temperature, s.temperature >= 0), ("top_p", s.top_p, 0 < s.top_p <= 1),
                           ("concurrency", s.concurrency, s.concurrency >= 1), ("retries", s.retries, s.retries >= 0),
                           ("retry_backoff", s.retry_backoff, s.retry_backoff >= 0),
                           ("request_timeout", s.timeout, s.timeout > 0)):
        if not ok:
            raise DraftTrainError(f"{key}={value}: out of range")


def regenerate_file_with_server(settings: ServerSettings, in_path, out_path, progress: bool = True,
                                skip_invalid: bool = False, on_row=None) -> dict[str, Any]:
    """Regenerate the JSONL file ``in_path`` into ``out_path`` through the server (resumable; ``in_path`` is
    only read). Stats as :func:`regenerate_with_server` plus ``invalid_skipped``."""
    convs = read_input(in_path, out_path, skip_invalid)
    stats = regenerate_with_server(settings, convs, out_path, progress=progress, on_row=on_row)
    stats["invalid_skipped"] = len(convs.skipped)
    return stats
