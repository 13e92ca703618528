"""drafttrain regenerate backend=openai: an OpenAI-compatible server answers the turns.

Retries, backoff, ordering, concurrency, multi-turn requests and truncation run against a small in-process HTTP
server (http.server in a thread) that answers as scripted; the slow tests run a real ``transformers serve`` of the
tiny built-in target on 127.0.0.1 (started once for the module, killed in its teardown, also on failure).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from drafttrain.data.chat import read_conversations
from drafttrain.data.regenerate import describe_stats
from drafttrain.data.regenerate_openai import (
    REQUEST_FIELDS, ServerSettings, backoff_delay, regenerate_file_with_server, request_seed,
)
from drafttrain.io import DraftTrainError

MAX_NEW = 12


# ------------------------------------------------------------------------------ a scripted in-process server
class FakeServer:
    """``/v1/chat/completions`` answered by ``reply(n, body) -> (status, json body | None, delay seconds)``
    (n = the request's number, from 0; a None body drops the connection without an answer). Records every
    request body with its arrival time and the most requests it ever had in flight."""

    def __init__(self, reply):
        self.reply, self.requests, self.lock = reply, [], threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.connections = []  # open keep-alive connections: a stopped server closes them too
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall between them

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with fake.lock:
                    fake.connections.append(self.connection)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    n = len(fake.requests)
                    fake.requests.append((time.time(), self.path, body))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    status, answer, delay = fake.reply(n, body)
                    time.sleep(delay)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                if answer is None:
                    self.close_connection = True
                    return
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def fake_server(reply):
    server = FakeServer(reply)
    try:
        yield server
    finally:
        server.stop()


def completion(text, finish="stop", tokens=None):
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(text) if tokens is None else tokens,
                      "total_tokens": 3}}


def echo(n, body, delay=0.0):
    """Answer ``A:<last user turn>``."""
    return 200, completion("A:" + body["messages"][-1]["content"]), delay


def settings(base_url, **kw):
    kw = {"model": "m", "max_new_tokens": MAX_NEW, "concurrency": 2, "retries": 2, "retry_backoff": 0.01,
          "timeout": 5.0, **kw}
    return ServerSettings(base_url=base_url, **kw)


def write_chats(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chats(n):
    return [{"id": f"q{k}", "messages": [{"role": "user", "content": f"u{k}"}, {"role": "assistant", "content": "old"}]}
            for k in range(n)]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ unit tests
def test_backoff_doubles_and_is_capped():
    assert [backoff_delay(k, 1.0) for k in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_delay(3, 0.25) == 2.0
    # a resumed run sends the same seeds: fixed by (seed, row, turn), different across rows and turns
    assert request_seed(0, 5, 1) == request_seed(0, 5, 1)
    assert len({request_seed(s, r, t) for s in (0, 1) for r in range(20) for t in range(3)}) == 120


def test_5xx_then_200_is_retried_with_growing_waits(tmp_path):
    def reply(n, body):  # the first two answers fail, then the server recovers
        return (500, {"error": {"message": "busy"}}, 0) if n < 2 else echo(n, body)

    inp, out = write_chats(tmp_path / "in.jsonl", chats(1)), tmp_path / "out.jsonl"
    with fake_server(reply) as fake:
        stats = regenerate_file_with_server(settings(fake.base_url, retries=3, retry_backoff=0.1), inp, out,
                                            progress=False)
    assert len(fake.requests) == 3 and stats["rows"] == 1
    assert _rows(out)[0]["messages"][1]["content"] == "A:u0"
    t = [r[0] for r in fake.requests]
    assert t[1] - t[0] >= 0.1 and t[2] - t[1] >= 0.2  # backoff 0.1 * 2**k


def test_connection_drop_and_timeout_are_retried(tmp_path):
    def reply(n, body):
        if n == 0:
            return 200, None, 0  # the connection closes without an answer
        if n == 1:
            return 200, completion("late"), 1.0  # past the 0.3 s request timeout
        return echo(n, body)

    inp, out = write_chats(tmp_path / "in.jsonl", chats(1)), tmp_path / "out.jsonl"
    with fake_server(reply) as fake:
        regenerate_file_with_server(settings(fake.base_url, timeout=0.3), inp, out, progress=False)
    assert len(fake.requests) == 3
    assert _rows(out)[0]["messages"][1]["content"] == "A:u0"


def test_persistent_5xx_stops_with_one_line_keeping_the_rows_written(tmp_path):
    def reply(n, body):
        return echo(n, body) if n == 0 else (503, {"error": {"message": "engine is dead"}}, 0)

    inp, out = write_chats(tmp_path / "in.jsonl", chats(3)), tmp_path / "out.jsonl"
    with fake_server(reply) as fake, pytest.raises(DraftTrainError) as e:
        regenerate_file_with_server(settings(fake.base_url, concurrency=1, retries=2), inp, out, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "after 3 attempts" in msg and "HTTP 503: engine is dead" in msg, msg
    assert "1 new rows were written (1 of 3 in" in msg and "rerun the same command" in msg, msg
    assert len(fake.requests) == 1 + 3  # row 0, then row 1 three times; row 2 never asked
    assert [r["id"] for r in _rows(out)] == ["q0"]
    # the server is back: the rerun continues after row 0
    with fake_server(echo) as fake:
        stats = regenerate_file_with_server(settings(fake.base_url, concurrency=1), inp, out, progress=False)
    assert (stats["already_done"], stats["rows"]) == (1, 2) and len(fake.requests) == 2
    assert [r["id"] for r in _rows(out)] == ["q0", "q1", "q2"]


def test_server_stopping_mid_run_is_one_line_and_a_rerun_completes(tmp_path):
    """A server that goes away mid-run (its socket closed: connection refused from then on)."""
    inp, out = write_chats(tmp_path / "in.jsonl", chats(6)), tmp_path / "out.jsonl"
    fake = FakeServer(lambda n, body: echo(n, body, delay=0.1))  # row 2 is in flight when it stops
    seen = []

    def on_row(i, row):
        seen.append(row["id"])
        if len(seen) == 2:
            fake.stop()

    with pytest.raises(DraftTrainError, match=r"no answer for .* after 2 attempts \(last: ConnectError.*is the "
                                              r"server running at base_url=http://127\.0\.0\.1"):
        regenerate_file_with_server(settings(fake.base_url, concurrency=1, retries=1), inp, out, progress=False,
                                    on_row=on_row)
    kept = [r["id"] for r in _rows(out)]
    assert kept[:2] == ["q0", "q1"] and kept == [f"q{k}" for k in range(len(kept))] and len(kept) < 6
    with fake_server(echo) as fake:
        regenerate_file_with_server(settings(fake.base_url), inp, out, progress=False)
    assert [r["id"] for r in _rows(out)] == [f"q{k}" for k in range(6)]


@pytest.mark.parametrize("status,body,needle", [
    (400, {"detail": "Server is pinned to 'a'; requested 'm'."}, "HTTP 400: Server is pinned to 'a'; requested 'm'."),
    (404, {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError"}},
     "HTTP 404: The model `m` does not exist."),
    (422, {"detail": [{"loc": ["body"], "msg": "field required"}]}, "HTTP 422: field required"),
])
def test_4xx_is_one_line_with_the_servers_message_and_no_retry(tmp_path, status, body, needle):
    inp, out = write_chats(tmp_path / "in.jsonl", chats(2)), tmp_path / "out.jsonl"
    with fake_server(lambda n, b: (status, body, 0)) as fake, pytest.raises(DraftTrainError) as e:
        regenerate_file_with_server(settings(fake.base_url, concurrency=1, retries=5, retry_backoff=30), inp, out,
                                    progress=False)
    assert needle in str(e.value) and "refused the request for" in str(e.value) and "\n" not in str(e.value)
    assert len(fake.requests) == 1 and out.read_text() == ""


def test_rows_are_written_in_input_order_with_requests_in_parallel(tmp_path):
    def reply(n, body):  # later rows answer first
        k = int(body["messages"][-1]["content"][1:])
        return echo(n, body, delay=0.05 * (8 - k))

    inp, out = write_chats(tmp_path / "in.jsonl", chats(8)), tmp_path / "out.jsonl"
    order = []
    with fake_server(reply) as fake:
        regenerate_file_with_server(settings(fake.base_url, concurrency=4), inp, out, progress=False,
                                    on_row=lambda i, row: order.append(i))
    assert fake.max_in_flight == 4
    assert order == list(range(8)) and [r["id"] for r in _rows(out)] == [f"q{k}" for k in range(8)]
    assert [r["messages"][1]["content"] for r in _rows(out)] == [f"A:u{k}" for k in range(8)]


def test_requests_run_at_most_a_window_ahead_of_the_next_row_to_write(tmp_path, monkeypatch):
    import drafttrain.data.regenerate_openai as R

    monkeypatch.setattr(R, "WINDOW", 2)  # 2 x concurrency 2: rows 0-3 while row 0 is slow

    def reply(n, body):
        return echo(n, body, delay=0.4 if body["messages"][-1]["content"] == "u0" else 0.0)

    inp, out = write_chats(tmp_path / "in.jsonl", chats(10)), tmp_path / "out.jsonl"
    with fake_server(reply) as fake:
        regenerate_file_with_server(settings(fake.base_url), inp, out, progress=False)
    t0 = fake.requests[0][0]
    early = [b["messages"][-1]["content"] for t, _, b in fake.requests if t < t0 + 0.3]
    assert sorted(early) == ["u0", "u1", "u2", "u3"], early
    assert [r["id"] for r in _rows(out)] == [f"q{k}" for k in range(10)]


def test_each_turn_is_asked_on_the_models_own_history_with_plain_fields(tmp_path):
    row = {"id": "m", "messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "one"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "two"}, {"role": "assistant", "content": "y"}]}
    inp, out = write_chats(tmp_path / "in.jsonl", [row]), tmp_path / "out.jsonl"
    with fake_server(echo) as fake:
        stats = regenerate_file_with_server(settings(fake.base_url, temperature=0.7, top_p=0.9, seed=3), inp, out,
                                            progress=False)
    bodies = [b for _, path, b in fake.requests]
    assert [p for _, p, _ in fake.requests] == ["/v1/chat/completions"] * 2
    assert all(set(b) == set(REQUEST_FIELDS) for b in bodies)
    assert bodies[0]["messages"] == row["messages"][:2]
    assert bodies[1]["messages"] == [*row["messages"][:2], {"role": "assistant", "content": "A:one"},
                                     row["messages"][3]]
    assert [(b["max_tokens"], b["temperature"], b["top_p"], b["model"]) for b in bodies] == \
        [(MAX_NEW, 0.7, 0.9, "m")] * 2
    assert [b["seed"] for b in bodies] == [request_seed(3, 0, 0), request_seed(3, 0, 1)]
    assert _rows(out)[0]["messages"][4] == {"role": "assistant", "content": "A:two"}
    assert (stats["turns"], stats["new_tokens"]) == (2, len("A:one") + len("A:two"))  # usage.completion_tokens


def test_progress_bar_shows_rows_and_completion_tokens_per_second(tmp_path, capsys):
    def reply(n, body):
        return 200, completion("x", tokens=500), 0.02

    inp = write_chats(tmp_path / "in.jsonl", chats(4))
    with fake_server(reply) as fake:
        regenerate_file_with_server(settings(fake.base_url, concurrency=1), inp, tmp_path / "out.jsonl")
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "4/4" in bar and "row/s" in bar, bar
    rate = float(bar.split(" tok/s")[0].rsplit(" ", 1)[-1])
    assert 500 <= rate <= 4 * 500 / 0.08, bar  # the server's completion_tokens over the run's time


def test_length_finish_is_a_truncated_turn_and_drop_truncated_drops_it(tmp_path):
    rows = [{"id": k, "messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "old"}]}
            for k, c in enumerate(["ok", "long", "ok"])]
    rows.append({"id": 3, "messages": [*rows[0]["messages"], {"role": "user", "content": "long"},
                                       {"role": "assistant", "content": "old"}]})
    inp = write_chats(tmp_path / "in.jsonl", rows)

    def reply(n, body):
        long = body["messages"][-1]["content"] == "long"
        return 200, completion("xx", finish="length" if long else "stop", tokens=MAX_NEW if long else 2), 0

    with fake_server(reply) as fake:
        kept = regenerate_file_with_server(settings(fake.base_url), inp, tmp_path / "keep.jsonl", progress=False)
        drop = regenerate_file_with_server(settings(fake.base_url, drop_truncated=True), inp,
                                           tmp_path / "drop.jsonl", progress=False)
    assert (kept["turns"], kept["truncated_turns"], kept["truncated_rows"], kept["dropped"]) == (5, 2, 2, 0)
    assert "2 turns (40.0%) in 2 rows stopped at max_new_tokens=12" in describe_stats(kept)
    assert (drop["dropped"], drop["truncated_dropped"], drop["truncated_cut"]) == (1, 1, 1)
    assert [c.row_id for c in read_conversations(tmp_path / "drop.jsonl")] == [0, 2, 3]
    assert len(read_conversations(tmp_path / "drop.jsonl")[2].messages) == 2  # row 3 ends before its long turn


def test_a_resume_with_other_settings_or_backend_is_refused(tmp_path):
    inp = write_chats(tmp_path / "in.jsonl", chats(3))
    out = tmp_path / "out.jsonl"
    with fake_server(echo) as fake:
        regenerate_file_with_server(settings(fake.base_url), inp, out, progress=False)
        out.write_text(out.read_text().splitlines()[0] + "\n")
        with pytest.raises(DraftTrainError, match=r"temperature: 0\.0 -> 0\.5"):
            regenerate_file_with_server(settings(fake.base_url, temperature=0.5), inp, out, progress=False)
        with pytest.raises(DraftTrainError, match=r"model: 'm' -> 'other'"):
            regenerate_file_with_server(settings(fake.base_url, model="other"), inp, out, progress=False)
        # an output of the HF path (its meta file has no "backend": written before it was recorded)
        meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
        for k in ("backend", "base_url", "concurrency"):
            del meta[k]
        (tmp_path / "out.jsonl.meta.json").write_text(json.dumps(meta))
        with pytest.raises(DraftTrainError, match=r"backend: 'hf' -> 'openai'"):
            regenerate_file_with_server(settings(fake.base_url), inp, out, progress=False)
        assert len(fake.requests) == 3


def _job(**updates):
    from drafttrain import config as C

    cfg = OmegaConf.structured(C.RegenerateJob)
    for k, v in {"input": "in.jsonl", "output": "out.jsonl", **updates}.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


@pytest.mark.parametrize("updates,needle", [
    ({"backend": "openai", "model": "m"}, "base_url is required with backend=openai"),
    ({"backend": "openai", "base_url": "http://h:1/v1"}, "model is required with backend=openai"),
    ({"backend": "openai", "base_url": "h:1/v1", "model": "m"}, "base_url=h:1/v1: expected an http:// or https://"),
    ({"base_url": "http://h:1/v1"}, "base_url=http://h:1/v1: only used with backend=openai"),
    ({"model": "m"}, "model=m: only used with backend=openai"),
    ({"backend": "vllm"}, "backend=vllm: expected one of hf, openai"),
])
def test_backend_settings_are_checked_in_one_line(updates, needle):
    from drafttrain.validate import check_values

    with pytest.raises(DraftTrainError) as e:
        check_values("regenerate", _job(**updates))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    check_values("regenerate", _job(backend="openai", base_url="https://h/v1", model="m", batch_size=16))
    check_values("regenerate", _job())  # backend=hf stays the default


# ------------------------------------------------------------------------- a real `transformers serve`
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_available() -> bool:
    from transformers.utils.import_utils import is_serve_available

    return is_serve_available()


@pytest.fixture(scope="module")
def served(tiny_builtin_target, tmp_path_factory):
    """``transformers serve <tiny target> --device cpu`` on a free port of 127.0.0.1; (base_url, model name).
    The server is pinned to the directory it was given, which is also the name requests must use."""
    if not _serve_available():
        pytest.skip("transformers serve needs transformers[serving] (the dev extra installs it)")
    port, model = _free_port(), str(tiny_builtin_target)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"transformers serve did not start in 180 s: {log.read_text()[-2000:]}")
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1", model
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def code_chats(tmp_path_factory):
    """6 rows: code prompts of the stdlib corpus and one multi-turn chat with a system turn."""
    from drafttrain.data import stdlib

    rows = [{"id": f"r{k}", "messages": c.messages()} for k, c in enumerate(stdlib.code_chats("draft")[:5])]
    rows.insert(2, {"id": "multi", "messages": [
        {"role": "system", "content": "You write Python."}, {"role": "user", "content": "def double(x):"},
        {"role": "assistant", "content": "    return 2 * x"}, {"role": "user", "content": "def triple(x):"},
        {"role": "assistant", "content": "    return 3 * x"}]})
    return write_chats(tmp_path_factory.mktemp("chats") / "in.jsonl", rows)


def _cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "drafttrain.cli", "regenerate", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def server_output(served, code_chats, tmp_path_factory):
    """The whole of ``code_chats`` regenerated through the server by the CLI (greedy, concurrency 3)."""
    base_url, model = served
    out = tmp_path_factory.mktemp("served") / "out.jsonl"
    r = _cli("backend=openai", f"base_url={base_url}", f"model={model}", f"input={code_chats}", f"output={out}",
             f"max_new_tokens={MAX_NEW}", "concurrency=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "regenerated 6 rows (7 turns, " in r.stdout, r.stdout
    return out


@pytest.mark.slow
def test_server_answers_are_the_hf_paths_at_temperature_0(served, server_output, code_chats, tiny_builtin_target,
                                                          tmp_path):
    """The server's rows are byte for byte the HF path's (greedy; the multi-turn row's second turn sees its own
    first answer in both). What could differ, and does not on these rows: ``transformers serve`` decodes its
    answer with ``skip_special_tokens=True`` (the HF path keeps a special token other than the end token in the
    text) and reports ``finish_reason="length"`` whenever it produced ``max_tokens`` tokens, even if the last
    was the end token (the HF path counts that turn as complete); the stats are compared too, so either would
    show here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttrain.data.regenerate import regenerate_file

    tok = AutoTokenizer.from_pretrained(str(tiny_builtin_target))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_builtin_target)).eval()
    hf_out = tmp_path / "hf.jsonl"
    hf = regenerate_file(model, tok, code_chats, hf_out, batch_size=1, max_new_tokens=MAX_NEW, progress=False)
    rows = _rows(server_output)
    assert [r["id"] for r in rows] == ["r0", "r1", "multi", "r2", "r3", "r4"]
    assert server_output.read_bytes() == hf_out.read_bytes()
    assert hf["turns"] == 7 and all(m["content"].strip() for r in rows for m in r["messages"])
    meta = json.loads(server_output.with_name("out.jsonl.meta.json").read_text())
    assert (meta["backend"], meta["base_url"], meta["model"]) == ("openai", served[0], str(tiny_builtin_target))
    assert (meta["max_new_tokens"], meta["temperature"], meta["concurrency"]) == (MAX_NEW, 0.0, 3)


@pytest.mark.slow
def test_server_run_killed_midway_resumes_without_duplicates(served, server_output, code_chats, tmp_path):
    base_url, model = served

    class Killed(BaseException):
        pass

    out = tmp_path / "out.jsonl"

    def die_after_two(i, row):
        if i == 1:
            raise Killed

    s = ServerSettings(base_url=base_url, model=model, max_new_tokens=MAX_NEW, concurrency=3)
    with pytest.raises(Killed):
        regenerate_file_with_server(s, code_chats, out, progress=False, on_row=die_after_two)
    assert [r["id"] for r in _rows(out)] == ["r0", "r1"]
    with open(out, "ab") as f:  # and a torn third row, as a kill mid-write leaves it
        f.write(b'{"id": "multi", "mess')
    stats = regenerate_file_with_server(s, code_chats, out, progress=False)
    assert (stats["already_done"], stats["rows"]) == (2, 4)
    ids = [r["id"] for r in _rows(out)]
    assert ids == ["r0", "r1", "multi", "r2", "r3", "r4"] and len(set(ids)) == len(ids)
    assert out.read_bytes() == server_output.read_bytes()


@pytest.mark.slow
def test_stopped_server_is_one_cli_line_and_keeps_the_rows(server_output, code_chats, tmp_path):
    """Nothing listens at base_url any more (a server that was stopped): exit status 2, one ``error:`` line, no
    traceback, the two rows already written and the meta file untouched."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(server_output.read_bytes().splitlines(keepends=True)[:2]))
    meta = server_output.with_name("out.jsonl.meta.json").read_bytes()
    (tmp_path / "out.jsonl.meta.json").write_bytes(meta)
    before = out.read_bytes()
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    model = json.loads(meta)["model"]
    r = _cli("backend=openai", f"base_url={dead}", f"model={model}", f"input={code_chats}", f"output={out}",
             f"max_new_tokens={MAX_NEW}", "concurrency=3", "retries=1", "retry_backoff=0.01")
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr[-3000:]
    assert "after 2 attempts" in errors[0] and "Connection refused" in errors[0] and "(2 of 6 in" in errors[0]
    assert out.read_bytes() == before
    recorded = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert recorded.pop("base_url") == dead  # the latest address is recorded; the settings are the same
    assert recorded == {k: v for k, v in json.loads(meta).items() if k != "base_url"}


@pytest.mark.slow
def test_wrong_model_name_is_the_servers_4xx_at_once(served, code_chats, tmp_path):
    base_url, _ = served
    s = ServerSettings(base_url=base_url, model="no-such-model", max_new_tokens=MAX_NEW, retries=3,
                       retry_backoff=30)
    t0 = time.time()
    with pytest.raises(DraftTrainError) as e:
        regenerate_file_with_server(s, code_chats, tmp_path / "out.jsonl", progress=False)
    assert time.time() - t0 < 20  # a retry would have waited 30 s
    msg = str(e.value)
    assert "HTTP 400: Server is pinned to" in msg and "requested 'no-such-model'" in msg and "\n" not in msg, msg
    assert (tmp_path / "out.jsonl").read_text() == ""
