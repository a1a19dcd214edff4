"""Soak and fault test of `specverify serve`: load, bad requests, a `kill -9` and a restart, on loopback.

    .venv/bin/python scripts/soak.py [--minutes 10] [--clients 64] [--kv-cache-memory 0.5]
        [--model PATH] [--speculative-config JSON | --no-speculation] [--port N] [--seed 0]

Starts the server (the default pair unless --model) with a small KV budget and an estimator state file
checkpointed every few seconds, then drives `--clients` concurrent clients (the official `openai`
client): completions and chat, streamed and not, `n` 2 and `logprobs` 2, streams the client closes after
a few chunks, one burst of long prompts that together exceed the KV budget, and about 5 % bad requests
sent raw (malformed JSON, wrong types, bad `max_tokens`, over-long prompts, invalid UTF-8, a 2 MB body,
an unknown model, `n` 17, `logprobs` 21). At 3/4 of the time it `kill -9`s the server mid-load,
restarts it on the same state file and checks the estimator came back from the checkpoint; the load
goes on for the rest of the time, then stops and the server is stopped with SIGTERM.

Everything is bounded: the run time, `--max-requests`, each request's timeout, the server's start.
Exit code 0 when the goals hold: no request lost (neither a full answer nor an error, while the script
was not killing the server), no 5xx (a 503 while shutting down excepted), peak RSS of the server within
budget + weights + 2 GiB ("weights": its RSS once it is up), the estimator restored, the server alive
at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

GIB = 1 << 30
RSS_POLL_S = 0.5
PROGRESS_S = 30.0
WORDS = "the cat sat on a mat and then it ran to see the dog in the park".split()
TOPICS = ["a lighthouse", "prime numbers", "a sorting function in Python", "the moon", "tea", "a robot"]


# ---- the tally ----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What happened to every request; updated from every client thread under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    completed: int = 0
    client4xx: Counter = field(default_factory=Counter)  # "400 invalid_json" -> count
    server5xx: Counter = field(default_factory=Counter)
    shutdown503: int = 0
    lost: Counter = field(default_factory=Counter)  # reason -> count
    killed: int = 0  # cut by the script's own kill -9
    disconnected: int = 0  # streams the script closed on purpose
    bad_accepted: Counter = field(default_factory=Counter)  # bad requests answered 200
    good_refused: Counter = field(default_factory=Counter)  # good requests answered 4xx
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def add(self, name: str, key: str | None = None, amount: float = 1) -> None:
        with self.lock:
            value = getattr(self, name)
            if isinstance(value, Counter):
                value[key] += amount
            elif isinstance(value, list):
                value.append(amount)
            else:
                setattr(self, name, value + amount)

    def line(self) -> str:
        with self.lock:
            return (
                f"sent {self.sent}, completed {self.completed}, 4xx {sum(self.client4xx.values())}, "
                f"5xx {sum(self.server5xx.values())}, lost {sum(self.lost.values())}, killed {self.killed}, "
                f"own disconnects {self.disconnected}"
            )


# ---- the server process -------------------------------------------------------------------------------


class Server:
    """`specverify serve` as a subprocess, its log in the work directory, its RSS polled."""

    def __init__(self, args: argparse.Namespace, workdir: Path, port: int) -> None:
        self.cmd = serve_command(args, workdir / "estimator.json", port)
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.starts = 0
        self.peak_rss = 0
        self.start_rss = 0  # RSS once the first server was up: weights plus the runtime
        self._poller = threading.Thread(target=self._poll_rss, daemon=True)
        self._stop = threading.Event()

    def start(self, timeout: float) -> None:
        self.starts += 1
        self._close_log()
        self._log = open(self.workdir / f"server-{self.starts}.log", "wb")  # the child writes to it
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up; its log:\n{self.log_tail()}")
            time.sleep(0.5)
        if not self.start_rss:
            self.start_rss = rss_bytes(self.proc.pid)
            self._poller.start()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL if it does not exit in time; its exit code."""
        self._stop.set()
        try:
            if self.proc is None or self.proc.poll() is not None:
                return None if self.proc is None else self.proc.returncode
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
                return None
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def metrics(self) -> dict[str, float]:
        """Every sample's value summed over its labels, by sample name."""
        out: Counter = Counter()
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] += sample.value
        return dict(out)

    def log_tail(self, lines: int = 40) -> str:
        text = (self.workdir / f"server-{self.starts}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _poll_rss(self) -> None:
        while not self._stop.wait(RSS_POLL_S):
            proc = self.proc
            if proc is not None and proc.poll() is None:
                self.peak_rss = max(self.peak_rss, rss_bytes(proc.pid))


def serve_command(args: argparse.Namespace, state: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "specverify.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--estimator-state", str(state), "--estimator-checkpoint-interval", str(args.checkpoint_interval)]
    cmd += ["--seed", str(args.seed), "--log-level", "info"]
    if args.model:
        cmd += ["--model", args.model]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    if args.no_speculation:
        cmd.append("--no-speculation")
    if args.kv_cache_memory and serve_supports("--kv-cache-memory"):
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    elif args.kv_cache_memory:
        print("soak: this serve has no --kv-cache-memory: running with its default KV budget", flush=True)
        args.kv_cache_memory = 0.0
    return cmd + args.serve_arg


def serve_supports(option: str) -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "specverify.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return option in help_text


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process just exited
        pass
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state_labels(path: Path) -> int:
    """Labels learned, summed over every estimator in a saved state file."""

    def walk(node: object) -> int:
        if isinstance(node, dict):
            return int(node.get("n_observed", 0)) + sum(walk(v) for k, v in node.items() if k != "n_observed")
        return 0

    return walk(json.loads(path.read_text()))


# ---- the clients --------------------------------------------------------------------------------------


class Load:
    """The clients' shared state: the kill window, the server generation, the stop flag."""

    def __init__(self, args: argparse.Namespace, server: Server, model: str, max_model_len: int) -> None:
        self.args = args
        self.server = server
        self.model = model
        self.max_model_len = max_model_len
        self.tally = Tally()
        self.stop = threading.Event()
        self.up = threading.Event()  # clear while the server is being killed and restarted
        self.up.set()
        self.killing = False
        self.shutting_down = False
        self.generation = 0  # bumped at each restart: requests of an older server were cut by the kill

    def cut_by_kill(self, generation: int) -> bool:
        return self.killing or generation != self.generation

    def take_ticket(self) -> bool:
        """Count a request about to be sent; False once --max-requests are sent."""
        with self.tally.lock:
            if self.tally.sent >= self.args.max_requests:
                return False
            self.tally.sent += 1
            return True


class Client:
    """One client thread: a random mix of requests until the load stops."""

    # (kind, weight); "bad" is about 5 % of the traffic.
    MIX = [
        ("completion", 20),
        ("completion_stream", 20),
        ("chat", 15),
        ("chat_stream", 15),
        ("disconnect", 10),
        ("n2", 5),
        ("logprobs2", 5),
        ("chat_logprobs2", 5),
        ("bad", 5),
    ]

    def __init__(self, load: Load, index: int) -> None:
        self.load = load
        self.rng = random.Random(load.args.seed * 1000 + index)
        self.generation = -1
        self.oai: openai.OpenAI | None = None
        self.http: httpx.Client | None = None

    def run(self) -> None:
        kinds, weights = zip(*self.MIX, strict=True)
        while not self.load.stop.is_set():
            if not self.load.up.wait(1.0):
                continue
            if not self.load.take_ticket():
                return
            self.request(self.rng.choices(kinds, weights)[0])

    def connect(self) -> None:
        """Fresh connections for each server generation: a dead server's pooled sockets are no use."""
        if self.generation == self.load.generation:
            return
        for c in (self.oai, self.http):
            if c is not None:
                c.close()
        self.generation = self.load.generation
        timeout = self.load.args.request_timeout
        self.oai = openai.OpenAI(
            base_url=f"{self.load.server.url}/v1", api_key="x", max_retries=0, timeout=timeout
        )
        self.http = httpx.Client(base_url=self.load.server.url, timeout=timeout)

    def request(self, kind: str, prompt: str | None = None, max_tokens: int | None = None) -> None:
        self.connect()
        generation = self.generation
        started = time.perf_counter()
        try:
            if kind == "bad":
                self.bad_request()
                return
            outcome = self.good_request(kind, started, prompt, max_tokens)
            if outcome == "whole":
                self.load.tally.add("completed")
                self.load.tally.add("latencies", amount=time.perf_counter() - started)
            elif outcome == "incomplete":
                self.connection_error("incomplete answer", generation)
            else:
                self.load.tally.add("disconnected")
        except openai.APIStatusError as e:
            self.status_error(e.status_code, error_code(e.body), generation)
        except openai.APIError as e:  # an error event inside a stream, or a connection / timeout error
            if isinstance(e, openai.APIConnectionError):
                self.connection_error(type(e).__name__, generation)
            else:
                body = e.body if isinstance(e.body, dict) else {}
                self.stream_error(body.get("type"), generation)
        except httpx.HTTPError as e:  # raised while iterating a stream the server cut
            self.connection_error(type(e).__name__, generation)
        except Exception as e:  # e.g. a response the client cannot parse: loud, and the thread lives on
            self.load.tally.add("lost", f"{type(e).__name__}: {str(e)[:80]}")

    def good_request(self, kind: str, started: float, prompt: str | None, max_tokens: int | None) -> str:
        """Send one valid request: "whole" (every choice with its finish reason, logprobs when asked),
        "incomplete", or "disconnected" (a stream this client closed early on purpose)."""
        rng, oai, model = self.rng, self.oai, self.load.model
        prompt = prompt or self.prompt()
        common = {
            "model": model,
            "max_tokens": max_tokens or rng.randint(4, self.load.args.max_tokens),
            "seed": rng.randint(0, 99),
        }
        common["temperature"] = rng.choice([0.0, 0.7, 1.0])
        messages = [{"role": "user", "content": prompt}]
        if kind == "completion":
            return whole(oai.completions.create(prompt=prompt, **common).choices, 1)
        if kind == "n2":
            return whole(oai.completions.create(prompt=prompt, n=2, **common).choices, 2)
        if kind == "logprobs2":
            return whole(
                oai.completions.create(prompt=prompt, logprobs=2, **common).choices, 1, logprobs=True
            )
        if kind == "chat":
            return whole(oai.chat.completions.create(messages=messages, **common).choices, 1)
        if kind == "chat_logprobs2":
            out = oai.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **common)
            return whole(out.choices, 1, logprobs=True)
        if kind in ("completion_stream", "disconnect"):
            stream = oai.completions.create(prompt=prompt, stream=True, **common)
        else:
            stream = oai.chat.completions.create(messages=messages, stream=True, **common)
        return self.read_stream(stream, started, rng.randint(1, 4) if kind == "disconnect" else None)

    def read_stream(self, stream: openai.Stream, started: float, close_after: int | None) -> str:
        """Read a stream to its end, or close it after `close_after` chunks (see `good_request`)."""
        finished, chunks, first = False, 0, True
        with stream:
            for chunk in stream:
                chunks += 1
                for choice in chunk.choices:
                    text = getattr(choice, "text", None) or getattr(
                        getattr(choice, "delta", None), "content", None
                    )
                    if text and first:
                        first = False
                        self.load.tally.add("ttfts", amount=time.perf_counter() - started)
                    finished = finished or choice.finish_reason is not None
                if close_after is not None and chunks >= close_after and not finished:
                    return "disconnected"  # closed by `with`: the server sees the client leave
        return "whole" if finished else "incomplete"

    def prompt(self) -> str:
        return f"Write a few lines about {self.rng.choice(TOPICS)}."

    def bad_request(self) -> None:
        kind, body = self.rng.choice(bad_bodies(self.load.model, self.load.max_model_len))
        path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
        generation = self.generation
        try:
            r = self.http.post(path, content=body, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            self.connection_error(type(e).__name__, generation)
            return
        if r.status_code < 400:
            self.load.tally.add("bad_accepted", kind)
            return
        code = error_code(r.json().get("error") if is_json(r) else None)
        self.status_error(r.status_code, code, generation, bad=True)

    def status_error(self, status: int, code: str, generation: int, bad: bool = False) -> None:
        tally = self.load.tally
        if 400 <= status < 500:
            tally.add("client4xx", f"{status} {code}")
            if not bad and status != 429:
                tally.add("good_refused", f"{status} {code}")
        elif status == 503 and self.load.shutting_down:
            tally.add("shutdown503")
        elif self.load.cut_by_kill(generation):
            tally.add("killed")
        else:
            tally.add("server5xx", f"{status} {code}")

    def stream_error(self, error_type: str | None, generation: int) -> None:
        status = {"server_shutdown": 503, "invalid_request_error": 400}.get(error_type or "", 500)
        self.status_error(status, f"{error_type} (in stream)", generation)

    def connection_error(self, what: str, generation: int) -> None:
        if self.load.cut_by_kill(generation):
            self.load.tally.add("killed")
        else:
            self.load.tally.add("lost", what)


def whole(choices: list, n: int, logprobs: bool = False) -> str:
    ok = len(choices) == n and all(c.finish_reason is not None for c in choices)
    return "whole" if ok and (not logprobs or choices[0].logprobs is not None) else "incomplete"


def error_code(error: object) -> str:
    if isinstance(error, dict):
        error = error.get("error", error)
    if not isinstance(error, dict):
        return "?"
    return str(error.get("code") or error.get("type") or "?")


def is_json(response: httpx.Response) -> bool:
    try:
        response.json()
    except ValueError:
        return False
    return True


def bad_bodies(model: str, max_model_len: int) -> list[tuple[str, bytes]]:
    """(kind, raw body) of requests the server must refuse with a 4xx."""

    def body(**fields: object) -> bytes:
        return json.dumps({"model": model, "prompt": "hello", "max_tokens": 4} | fields).encode()

    return [
        ("malformed_json", b'{"model": "' + model.encode() + b'", "prompt": "hel'),
        ("wrong_types", body(prompt={"a": 1}, max_tokens="four")),
        ("negative_max_tokens", body(max_tokens=-5)),
        ("huge_max_tokens", body(max_tokens=10**12)),
        ("over_context", body(prompt=[100] * (max_model_len + 8))),
        ("invalid_utf8", b'{"model": "' + model.encode() + b'", "prompt": "caf\xc3\x28 \xff\xfe"}'),
        ("big_body", body(prompt="word " * (2 * 1024 * 1024 // 5))),
        ("unknown_model", body(model="no-such-model")),
        ("n_too_large", body(n=17)),
        ("logprobs_too_large", body(logprobs=21)),
        (
            "chat_top_logprobs_too_large",
            json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "logprobs": True,
                    "top_logprobs": 21,
                }
            ).encode(),
        ),
    ]


def long_prompt(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of plain words (one token each in common tokenizers)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens)) + "\nSummarise the text above."


# ---- the run ------------------------------------------------------------------------------------------


def fire_burst(load: Load, count: int, tokens: int) -> list[threading.Thread]:
    """`count` long prompts at once, from their own threads (they join the tally like any request).
    Their lengths vary and they generate the most tokens, so as they grow some cross a KV block and the
    engine has to preempt."""

    def one(i: int) -> None:
        if load.take_ticket():
            client = Client(load, 10_000 + i)
            prompt = long_prompt(client.rng.randint(tokens // 2, tokens), client.rng)
            client.request("completion", prompt, max_tokens=load.args.max_tokens)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def kill_and_restart(load: Load, args: argparse.Namespace) -> dict[str, object]:
    """kill -9 mid-load, restart on the same state file; what the estimator had, kept and got back."""
    server = load.server
    deadline = time.monotonic() + 3 * args.checkpoint_interval + 10
    before = server.metrics()
    has_estimator = "specverify_estimator_observed_labels" in before
    while has_estimator and "specverify_estimator_checkpoint_timestamp_seconds" not in before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
        before = server.metrics()
    load.up.clear()
    load.killing = True
    server.kill9()
    killed_at = time.time()
    state = server.workdir / "estimator.json"
    result: dict[str, object] = {
        "has_estimator": has_estimator,
        "labels_before_kill": before.get("specverify_estimator_observed_labels"),
        "preemptions_before_kill": before.get("specverify_preemptions_total"),
        "checkpoint_age_s": killed_at
        - before.get("specverify_estimator_checkpoint_timestamp_seconds", killed_at),
        "labels_in_file": state_labels(state) if state.exists() else None,
    }
    started = time.monotonic()
    server.start(args.startup_timeout)
    result["restart_s"] = time.monotonic() - started
    result["labels_restored"] = server.metrics().get("specverify_estimator_observed_labels")
    load.generation += 1
    load.killing = False
    load.up.set()
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_load(load: Load, args: argparse.Namespace) -> tuple[dict[str, object], list[threading.Thread]]:
    """`--minutes` of load (not counting the restart): the burst at 30 %, the kill -9 at 75 %."""
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    burst_at, kill_at = t0 + 0.3 * (end - t0), t0 + 0.75 * (end - t0)
    burst_tokens = min(args.long_prompt_tokens, load.max_model_len // 2)
    bursts: list[threading.Thread] = []
    restart: dict[str, object] = {}
    next_progress = t0 + PROGRESS_S
    while time.monotonic() < end:
        now = time.monotonic()
        if not bursts and now >= burst_at:
            print(f"soak: burst of {args.burst} prompts of ~{burst_tokens} tokens", flush=True)
            bursts = fire_burst(load, args.burst, burst_tokens)
        if not restart and now >= kill_at:
            print("soak: kill -9 mid-load", flush=True)
            restart = kill_and_restart(load, args)
            end += time.monotonic() - now  # the time without a server does not count as load
            print(f"soak: restarted in {restart['restart_s']:.1f} s", flush=True)
        if now >= next_progress:
            rss = load.server.peak_rss / GIB
            print(f"soak [{now - t0:5.0f} s] {load.tally.line()}, server RSS peak {rss:.2f} GiB", flush=True)
            next_progress += PROGRESS_S
        time.sleep(0.2)
    return restart, bursts


def run(args: argparse.Namespace, workdir: Path) -> int:
    server = Server(args, workdir, args.port or free_port())
    print(f"soak: starting {' '.join(server.cmd)}", flush=True)
    try:
        return drive(args, server)
    finally:
        server.stop()  # a no-op once the run stopped it; otherwise never leave a server behind


def drive(args: argparse.Namespace, server: Server) -> int:
    """Start the server, run the load with its burst and its kill -9, stop, report."""
    server.start(args.startup_timeout)
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    load = Load(args, server, card["id"], int(card["max_model_len"]))
    print(
        f"soak: server up ({card['id']}, context {load.max_model_len}), RSS {server.start_rss / GIB:.2f} GiB",
        flush=True,
    )

    clients = [threading.Thread(target=Client(load, i).run, daemon=True) for i in range(args.clients)]
    for t in clients:
        t.start()
    t0 = time.monotonic()
    restart, bursts = run_load(load, args)
    load.stop.set()
    threads = clients + bursts
    deadline = time.monotonic() + args.request_timeout + 10
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    stuck = sum(t.is_alive() for t in threads)
    alive = server.healthy()
    final = server.metrics() if alive else {}
    load.shutting_down = True
    exit_code = server.stop()
    return report(load, server, restart, final, alive, stuck, exit_code, time.monotonic() - t0)


def report(
    load: Load,
    server: Server,
    restart: dict[str, object],
    final: dict[str, float],
    alive: bool,
    stuck: int,
    exit_code: int | None,
    seconds: float,
) -> int:
    t, args = load.tally, load.args
    lost = sum(t.lost.values()) + stuck
    print(f"\n==== soak summary ({seconds:.0f} s, {args.clients} clients) ====")
    print(f"requests sent      {t.sent}")
    print(f"completed          {t.completed}")
    print(
        f"4xx                {sum(t.client4xx.values())}  "
        + ", ".join(f"{k}: {v}" for k, v in sorted(t.client4xx.items()))
    )
    print(
        f"5xx                {sum(t.server5xx.values())}  "
        + ", ".join(f"{k}: {v}" for k, v in sorted(t.server5xx.items()))
    )
    print(f"503 at shutdown    {t.shutdown503}")
    print(
        f"lost               {lost}  "
        + ", ".join(f"{k}: {v}" for k, v in sorted(t.lost.items()))
        + (f", still running at the end: {stuck}" if stuck else "")
    )
    print(f"cut by the kill -9 {t.killed}")
    print(f"own disconnects    {t.disconnected}")
    if t.good_refused:
        print("good requests refused: " + ", ".join(f"{k}: {v}" for k, v in sorted(t.good_refused.items())))
    if t.bad_accepted:
        print("bad requests accepted: " + ", ".join(f"{k}: {v}" for k, v in sorted(t.bad_accepted.items())))
    print(f"latency p50 / p99  {percentile(t.latencies, 0.5):.2f} / {percentile(t.latencies, 0.99):.2f} s")
    print(f"TTFT p50 / p99     {percentile(t.ttfts, 0.5):.2f} / {percentile(t.ttfts, 0.99):.2f} s (streams)")
    counts = [
        c for c in (restart.get("preemptions_before_kill"), final.get("specverify_preemptions_total")) if c
    ]
    preemptions = "n/a (no metric)" if "specverify_preemptions_total" not in final else int(sum(counts))
    print(f"preemptions        {preemptions} (both server processes)")
    for name in sorted(k for k in final if k.startswith("specverify_kv_")):
        print(f"{name:<18} {final[name]:.0f}")
    budget = args.kv_cache_memory * GIB or kv_budget_metric(final)
    rss_limit = server.start_rss + budget + 2 * GIB
    print(
        f"server RSS         peak {server.peak_rss / GIB:.2f} GiB; at start (weights) {server.start_rss / GIB:.2f} "
        f"GiB + KV budget {budget / GIB:.2f} GiB + 2 GiB = {rss_limit / GIB:.2f} GiB"
    )
    estimator_ok = estimator_report(restart)
    # uvicorn re-raises the SIGTERM it handled once its shutdown is done: -15 is a clean exit.
    print(f"server alive       {alive} (exit code after SIGTERM: {exit_code})")
    goals = {
        "0 lost": lost == 0,
        "no 5xx": not t.server5xx,
        "peak RSS within budget": server.peak_rss <= rss_limit,
        "estimator restored": estimator_ok,
        "server alive at the end": alive,
    }
    print("goals              " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in goals.items()))
    return 0 if all(goals.values()) else 1


def kv_budget_metric(metrics: dict[str, float]) -> float:
    """The server's own KV budget in bytes when /metrics shows one (its default budget), else 0."""
    return next((v for k, v in metrics.items() if "kv" in k and "budget" in k and k.endswith("bytes")), 0.0)


def estimator_report(restart: dict[str, object]) -> bool:
    if not restart:
        print("estimator          no kill happened (run too short?)")
        return False
    if not restart["has_estimator"]:
        print("estimator          none (no speculation): restore not checked")
        return True
    restored, in_file = restart["labels_restored"], restart["labels_in_file"]
    print(
        f"estimator          labels before the kill {restart['labels_before_kill']:.0f}, in the checkpoint "
        f"{in_file} (written {restart['checkpoint_age_s']:.1f} s before the kill), restored {restored:.0f}"
    )
    return in_file is not None and in_file > 0 and restored == in_file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--model", help="passed to serve (default: the default pair)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--speculative-config", help="passed to serve")
    group.add_argument("--no-speculation", action="store_true", help="passed to serve")
    p.add_argument(
        "--kv-cache-memory", type=float, default=0.5, help="GiB for serve's KV budget (0: its default)"
    )
    p.add_argument("--port", type=int, default=0, help="default: a free port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint-interval", type=float, default=10.0, help="serve's --estimator-checkpoint-interval"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of a normal request")
    p.add_argument("--long-prompt-tokens", type=int, default=2000, help="length of the burst's prompts")
    p.add_argument("--burst", type=int, help="long prompts in the burst (default: clients / 4)")
    p.add_argument("--max-requests", type=int, default=200_000, help="stop sending after this many")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more serve argument, e.g. --serve-arg=--max-num-seqs=16",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (server logs, state file)")
    args = p.parse_args()
    if args.burst is None:
        args.burst = max(1, args.clients // 4)
    workdir = Path(tempfile.mkdtemp(prefix="specverify-soak-"))
    server_logs = "kept" if args.keep else "removed on success"
    print(f"soak: work directory {workdir} ({server_logs})", flush=True)
    code = 1
    try:
        code = run(args, workdir)
    finally:
        if code == 0 and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"soak: server logs in {workdir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
