"""`specverify serve`: the OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

Each test runs a real uvicorn server on 127.0.0.1 in a thread, over toy models (tiny vocabulary, logits
from a random n-gram table), so the whole path (HTTP -> worker thread -> engine -> SSE) is exercised in
well under a second per test. One test at the end uses the small real model when it is installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specverify.config import EngineConfig, SpeculativeConfig
from specverify.engine.llm_engine import LLMEngine
from specverify.models.toy import ToyRunner, ToyTokenizer, table_logits
from specverify.server.app import SpecverifyServer, create_app

VOCAB = 32
MODEL = "toy"
HAS_ESTIMATOR = all(
    importlib.util.find_spec(m) is not None for m in ("specverify.estimator", "specverify.calibration")
)


class ChatToyTokenizer(ToyTokenizer):
    """The toy tokenizer plus a chat template; any word that is not `tN` maps to some token id."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            ids.append(
                int(word[1:]) % VOCAB
                if word[:1] == "t" and word[1:].isdigit()
                else sum(map(ord, word)) % VOCAB
            )
        return ids

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True
    ):
        if messages[-1]["role"] == "assistant":
            raise ValueError("the conversation must end with a user message")
        return " ".join(f"t{len(m['role'])} {m['content']}" for m in messages) + " t0"


class SlowToyRunner(ToyRunner):
    """A toy runner that takes `delay` seconds per forward, so requests stay in flight long enough."""

    def __init__(self, *args, delay: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    def forward(self, seq_ids, tokens, num_logits):
        if self.delay:
            time.sleep(self.delay)
        return super().forward(seq_ids, tokens, num_logits)


def make_engine(
    speculative: bool = True, max_num_seqs: int = 16, delay: float = 0.0, max_model_len: int = 4096
) -> LLMEngine:
    target_fn = table_logits(VOCAB, 1, sharpness=2.0)
    noise_fn = table_logits(VOCAB, 2, sharpness=1.0)
    target = SlowToyRunner(VOCAB, target_fn, max_model_len=max_model_len, delay=delay)
    spec = None
    draft = None
    if speculative and HAS_ESTIMATOR:
        spec = SpeculativeConfig(num_speculative_tokens=3)
        draft = ToyRunner(VOCAB, lambda c: target_fn(c) + noise_fn(c), max_model_len=max_model_len)
    config = EngineConfig(max_num_seqs=max_num_seqs, speculative=spec)
    return LLMEngine(
        target, ChatToyTokenizer(VOCAB, eos_token_id=None), config, draft=draft, model_name=MODEL
    )


@dataclass
class Served:
    url: str
    server: SpecverifyServer
    thread: threading.Thread

    @property
    def worker(self):
        return self.server.ctx.worker

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def wait_for(self, predicate, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.request_shutdown()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not shut down"


@contextmanager
def serve(engine: LLMEngine, **kwargs) -> Iterator[Served]:
    app = create_app(engine, served_model_name=MODEL, **kwargs)
    server = SpecverifyServer(app, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    served.wait_for(lambda: server.started, timeout=10)
    try:
        yield served
    finally:
        if thread.is_alive():
            served.stop()
        sock.close()


def completion_body(**overrides) -> dict:
    return {"model": MODEL, "prompt": "t1 t2 t3", "max_tokens": 5, "temperature": 0} | overrides


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


# ---- the API with the official client -------------------------------------------------------------


def test_openai_client_completions_chat_streaming_and_usage() -> None:
    with serve(make_engine(), model_aliases=("toy.gguf",)) as s:
        client = s.client()
        assert [m.id for m in client.models.list().data] == [MODEL]
        alias = client.completions.create(model="toy.gguf", prompt="t1", max_tokens=2)
        assert alias.model == MODEL and alias.usage.completion_tokens == 2
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}

        done = client.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=7, temperature=0)
        assert done.object == "text_completion" and done.model == MODEL and done.id.startswith("cmpl-")
        assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 7
        assert done.usage.total_tokens == 10 and done.created > 0
        choice = done.choices[0]
        assert choice.finish_reason == "length" and len(choice.text.split()) == 7

        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="t1 t2 t3",
                max_tokens=7,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == choice.text  # greedy: the same continuation, delivered piece by piece
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].choices == []

        messages = [{"role": "user", "content": "hello there"}]
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, seed=3
        )
        assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens == 4  # "t4 hello there t0"
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta for c in stream]
        assert pieces[0].role == "assistant"
        assert "".join(d.content or "" for d in pieces) == chat.choices[0].message.content

        # Sampling knobs pass through: stop strings cut the text, top_k rides in extra_body, seeds repeat.
        stopped = client.completions.create(
            model=MODEL, prompt="t1 t2 t3", max_tokens=7, temperature=0, stop=[" "]
        )
        assert stopped.choices[0].finish_reason == "stop" and " " not in stopped.choices[0].text
        a, b = (
            client.completions.create(
                model=MODEL,
                prompt="t4",
                max_tokens=12,
                temperature=1.0,
                top_p=0.9,
                seed=7,
                extra_body={"top_k": 5},
            )
            .choices[0]
            .text
            for _ in range(2)
        )
        assert a == b


def test_metrics_expose_speculation_state() -> None:
    with serve(make_engine()) as s:
        client = s.client()
        for i in range(3):
            client.completions.create(model=MODEL, prompt=f"t{i} t5", max_tokens=20, temperature=1.0, seed=i)
        s.wait_for(lambda: s.metrics().get(("specverify_in_flight_requests", ())) == 0)
        m = s.metrics()
        assert m[("specverify_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 3
        assert m[("specverify_output_tokens_total", ())] == 60
        assert m[("specverify_requests_finished_total", (("finish_reason", "length"),))] == 3
        assert m[("specverify_queue_depth", ())] == 0
        assert m[("specverify_step_seconds_count", ())] >= 1
        assert m[("specverify_time_to_first_token_seconds_count", ())] == 3
        assert ("specverify_chosen_verify_budget", ()) in m and ("specverify_chosen_draft_depth", ()) in m
        if HAS_ESTIMATOR:
            drafted = m[("specverify_drafted_tokens_total", (("position", "0"),))]
            verified = m[("specverify_verified_tokens_total", (("position", "0"),))]
            accepted = m[("specverify_accepted_tokens_total", (("position", "0"),))]
            assert drafted >= verified >= accepted > 0
            drafter = ("drafter", "draft_model")
            assert m[("specverify_drafter_info", (drafter,))] == 1.0
            assert ("specverify_estimator_slope", (drafter,)) in m
            assert ("specverify_estimator_intercept", (drafter, ("position", "2"))) in m
            assert 0.0 <= m[("specverify_estimator_ece", (drafter,))] <= 1.0
            assert m[("specverify_estimator_calibration", (drafter, ("statistic", "labels")))] > 0


# ---- load --------------------------------------------------------------------------------------------


def test_64_concurrent_clients_all_complete() -> None:
    """Half stream, half not; clients i and i + 32 ask the same greedy question and must agree."""
    n = 64
    with serve(make_engine(max_num_seqs=16), max_queue=64) as s:

        async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, int, str]:
            j = i % 32
            max_tokens = 4 + j % 13
            prompt = f"t{j % VOCAB} t{(3 * j) % VOCAB}"
            chat = j % 2 == 1
            if i < 32:  # not streamed
                if chat:
                    r = await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=max_tokens,
                        temperature=0,
                    )
                    return (
                        i,
                        r.choices[0].message.content,
                        r.usage.completion_tokens,
                        r.choices[0].finish_reason,
                    )
                r = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
                )
                return i, r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
            opts = {"include_usage": True}
            if chat:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options=opts,
                )
                text, usage, reason = "", None, None
                async for c in stream:
                    if c.choices:
                        text += c.choices[0].delta.content or ""
                        reason = c.choices[0].finish_reason or reason
                    usage = c.usage or usage
                return i, text, usage.completion_tokens, reason
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options=opts,
            )
            text, usage, reason = "", None, None
            async for c in stream:
                if c.choices:
                    text += c.choices[0].text
                    reason = c.choices[0].finish_reason or reason
                usage = c.usage or usage
            return i, text, usage.completion_tokens, reason

        async def everyone() -> list[tuple[int, str, int, str]]:
            async with openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0) as client:
                return await asyncio.gather(*(one(client, i) for i in range(n)))

        start = time.perf_counter()
        results = asyncio.run(asyncio.wait_for(everyone(), timeout=45))
        elapsed = time.perf_counter() - start
        by_id = {i: (text, count, reason) for i, text, count, reason in results}
        assert len(by_id) == n
        for i in range(32):
            max_tokens = 4 + i % 13
            for k in (i, i + 32):
                text, count, reason = by_id[k]
                assert count == max_tokens and reason == "length", (k, by_id[k])
                assert len(text.split()) == max_tokens, (k, text)
            assert by_id[i][0] == by_id[i + 32][0]  # streamed text == whole text
        s.wait_for(lambda: s.worker.in_flight == 0)
        m = s.metrics()
        expected_tokens = 2 * sum(4 + i % 13 for i in range(32))
        assert m[("specverify_output_tokens_total", ())] == expected_tokens
        ok = sum(
            v
            for (name, labels), v in m.items()
            if name == "specverify_requests_total" and ("status", "200") in labels
        )
        assert ok >= n
        assert m[("specverify_requests_finished_total", (("finish_reason", "length"),))] == n
        print(
            f"\n64 clients: {elapsed:.2f} s, {expected_tokens} tokens, {m[('specverify_engine_steps_total', ())]:.0f} steps"
        )


# ---- faults ------------------------------------------------------------------------------------------


def test_full_queue_answers_429_and_disconnects_free_slots() -> None:
    with serve(make_engine(max_num_seqs=1, delay=0.01), max_queue=1) as s:
        long = completion_body(max_tokens=500, stream=True)
        with httpx.Client(timeout=10) as a, httpx.Client(timeout=10) as b:
            with a.stream("POST", f"{s.url}/v1/completions", json=long) as first:
                assert first.status_code == 200
                first_lines = first.iter_lines()  # keep it referenced: a dropped iterator closes the stream
                assert next(first_lines).startswith("data: ")  # the first request is producing tokens
                with b.stream("POST", f"{s.url}/v1/completions", json=long) as second:
                    assert second.status_code == 200  # accepted into the queue (its headers come at once)
                    s.wait_for(lambda: s.worker.in_flight == 2)
                    started = time.perf_counter()
                    full = httpx.post(f"{s.url}/v1/completions", json=completion_body(), timeout=5)
                    assert time.perf_counter() - started < 2  # answered, not left hanging
                    assert_error(full, 429, code="queue_full")
                    assert full.headers["Retry-After"] == "1"
                    with pytest.raises(openai.RateLimitError):
                        s.client().completions.create(model=MODEL, prompt="t1", max_tokens=2)
                # Leaving the `with` closes the connections mid-stream: the worker must abort both.
        s.wait_for(lambda: s.worker.in_flight == 0)
        s.wait_for(lambda: s.metrics()[("specverify_running_requests", ())] == 0)
        steps = s.metrics()[("specverify_engine_steps_total", ())]
        time.sleep(0.1)
        assert s.metrics()[("specverify_engine_steps_total", ())] == steps  # the engine went idle
        assert s.metrics()[("specverify_requests_finished_total", (("finish_reason", "abort"),))] == 2
        ok = httpx.post(f"{s.url}/v1/completions", json=completion_body(), timeout=5)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5

        # A client that gives up on a non-streamed request frees its slot too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json=completion_body(max_tokens=500), timeout=0.3)
        s.wait_for(lambda: s.worker.in_flight == 0, timeout=5)
        assert s.metrics()[("specverify_requests_finished_total", (("finish_reason", "abort"),))] == 3
        assert httpx.post(f"{s.url}/v1/completions", json=completion_body(), timeout=5).status_code == 200


BAD_REQUESTS = [
    # (description, path, body or raw bytes, status, param, code)
    ("malformed JSON", "/v1/completions", b'{"model": "toy", "prompt": ', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("unknown model", "/v1/completions", completion_body(model="gpt-9"), 404, "model", "model_not_found"),
    ("negative temperature", "/v1/completions", completion_body(temperature=-1), 400, "temperature", None),
    (
        "temperature not a number",
        "/v1/completions",
        completion_body(temperature="hot"),
        400,
        "temperature",
        None,
    ),
    ("top_p zero", "/v1/completions", completion_body(top_p=0), 400, "top_p", None),
    ("bad top_k", "/v1/completions", completion_body(top_k=-5), 400, "top_k", None),
    ("max_tokens zero", "/v1/completions", completion_body(max_tokens=0), 400, "max_tokens", None),
    ("n > 1", "/v1/completions", completion_body(n=3), 400, "n", None),
    ("empty prompt", "/v1/completions", completion_body(prompt=""), 400, "prompt", None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("token out of vocabulary", "/v1/completions", completion_body(prompt=[1, 999]), 400, "prompt", None),
    (
        "too long prompt",
        "/v1/completions",
        completion_body(prompt=" ".join(["t1"] * 80)),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "prompt + max_tokens too long",
        "/v1/completions",
        completion_body(max_tokens=100),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("batched prompts", "/v1/completions", completion_body(prompt=["t1", "t2"]), 400, "prompt", None),
    ("bad logit_bias", "/v1/completions", completion_body(logit_bias={"abc": 1}), 400, "logit_bias", None),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    (
        "unknown role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages",
        None,
    ),
    (
        "template rejects",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]},
        400,
        "messages",
        None,
    ),
    (
        "chat n > 1",
        "/v1/chat/completions",
        {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "x"}]},
        400,
        "n",
        None,
    ),
]


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving() -> None:
    with serve(make_engine(max_model_len=64)) as s, httpx.Client(timeout=5) as http:
        for description, path, body, status, param, code in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(f"{s.url}{path}", content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(f"{s.url}{path}", json=body)
            assert_error(r, status, param, code), description
            good = http.post(f"{s.url}/v1/completions", json=completion_body())
            assert good.status_code == 200, (description, good.text)
            assert good.json()["usage"]["completion_tokens"] == 5
        assert_error(http.get(f"{s.url}/v1/nothing"), 404, code="not_found")
        assert_error(http.get(f"{s.url}/v1/completions"), 405)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            s.client().completions.create(model="nope", prompt="t1")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            s.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=500
            )
        assert s.worker.alive and s.worker.in_flight == 0


class FailingRunner(SlowToyRunner):
    """Raises inside the forward pass whenever token 31 is fed: an engine fault in the middle of a step."""

    def forward(self, seq_ids, tokens, num_logits):
        if any(31 in t for t in tokens):
            raise RuntimeError("simulated kernel failure")
        return super().forward(seq_ids, tokens, num_logits)


def test_engine_failure_ends_the_batch_with_500_and_the_server_recovers() -> None:
    engine = make_engine(speculative=False)
    engine.target = FailingRunner(VOCAB, engine.target.logits_fn)
    with serve(engine) as s, httpx.Client(timeout=5) as http:
        r = http.post(f"{s.url}/v1/completions", json=completion_body(prompt=[31, 1]))
        assert "simulated kernel failure" in assert_error(r, 500)
        good = http.post(f"{s.url}/v1/completions", json=completion_body(prompt=[1, 2]))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
        assert s.worker.failed_steps == 1 and s.worker.in_flight == 0


def test_serve_subcommand_is_registered() -> None:
    from specverify.cli import build_parser
    from specverify.server.cli import run

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m.gguf",
            "--no-speculation",
            "--port",
            "9",
            "--max-queue",
            "3",
            "--estimator-state",
            "e.json",
            "--shutdown-timeout",
            "2",
        ]
    )
    assert args.func is run and args.port == 9 and args.max_queue == 3 and args.estimator_state == "e.json"
    args.max_queue = -1
    with pytest.raises(SystemExit, match="max-queue"):
        run(args)


# ---- shutdown and persistence ------------------------------------------------------------------------


class FakeEstimator:
    """Stands in for the acceptance estimator when the real one is not importable (plain engine)."""

    def __init__(self) -> None:
        self.state = {"slope": 0.5, "intercepts": [-0.2, -0.4, -0.6]}

    @property
    def coef_(self):
        return self.state["slope"], self.state["intercepts"]

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def _engine_with_estimator(**kwargs) -> LLMEngine:
    engine = make_engine(**kwargs)
    if engine.estimator is None:
        engine.estimator = FakeEstimator()
    return engine


def test_graceful_shutdown_finishes_in_flight_and_saves_the_estimator(tmp_path) -> None:
    path = tmp_path / "estimator.json"
    with serve(_engine_with_estimator(delay=0.005), estimator_state=str(path), shutdown_timeout=20) as s:
        s.client().completions.create(model=MODEL, prompt="t1 t2", max_tokens=30, temperature=1.0, seed=1)
        lines: list[str] = []

        def read_stream() -> None:
            with httpx.stream(
                "POST",
                f"{s.url}/v1/completions",
                json=completion_body(max_tokens=60, stream=True),
                timeout=20,
            ) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read_stream)
        reader.start()
        s.wait_for(lambda: len(lines) > 0)  # the stream is under way
        s.stop()  # returns once the server has drained and exited
        reader.join(timeout=10)
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events).split().__len__() == 60
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        saved_engine = s.worker.engine
    assert path.exists()
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(saved_engine.estimator_state()))

    # A new server restores the saved state before it serves.
    fresh = _engine_with_estimator()
    if isinstance(fresh.estimator, FakeEstimator):
        fresh.estimator.state = {"slope": 9.0, "intercepts": []}
    with serve(fresh, estimator_state=str(path)) as s2:
        assert json.loads(json.dumps(s2.worker.engine.estimator_state())) == saved
        m = s2.metrics()
        assert ("specverify_estimator_slope", (("drafter", "draft_model"),)) in m


def test_shutdown_deadline_ends_in_flight_requests_with_an_error() -> None:
    with serve(make_engine(delay=0.01), shutdown_timeout=0.3) as s:
        lines: list[str] = []
        result: dict = {}

        def read_stream() -> None:
            with httpx.stream(
                "POST",
                f"{s.url}/v1/completions",
                json=completion_body(max_tokens=2000, stream=True),
                timeout=20,
            ) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def whole() -> None:
            result["response"] = httpx.post(
                f"{s.url}/v1/completions", json=completion_body(max_tokens=2000), timeout=20
            )

        threads = [threading.Thread(target=read_stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        s.wait_for(lambda: s.worker.in_flight == 2)
        started = time.perf_counter()
        s.stop()
        for t in threads:
            t.join(timeout=10)
        assert time.perf_counter() - started < 10
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        assert "shut down" in last["error"]["message"]
        assert_error(result["response"], 503)


# ---- the small real model ----------------------------------------------------------------------------


@pytest.mark.integration
def test_real_model_chat_over_http(smollm2_gguf, specverify_cache) -> None:
    from specverify.models.loader import load_model, load_tokenizer
    from specverify.models.runner import TorchModelRunner

    # One load serves as target and draft (separate KV caches over shared weights): loading is the slow part.
    model, config = load_model(smollm2_gguf, dtype="bfloat16", progress=False)
    target = TorchModelRunner(model, config, dtype="bfloat16", max_model_len=256)
    draft = TorchModelRunner(model, config, dtype="bfloat16", max_model_len=256)
    spec = SpeculativeConfig(num_speculative_tokens=3)
    engine = LLMEngine(
        target, load_tokenizer(smollm2_gguf), EngineConfig(max_num_seqs=4, speculative=spec), draft=draft
    )
    with serve(engine, max_queue=8) as s:
        client = s.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        text = whole.choices[0].message.content
        assert "Paris" in text and whole.usage.completion_tokens <= 10
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        m = s.metrics()
        assert m[("specverify_drafted_tokens_total", (("position", "0"),))] > 0
        assert m[("specverify_accepted_tokens_total", (("position", "0"),))] > 0  # a model agrees with itself


def test_a_suffix_drafting_server_names_its_drafter_in_the_metrics() -> None:
    target = SlowToyRunner(VOCAB, table_logits(VOCAB, 1, sharpness=2.0))
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    engine = LLMEngine(
        target, ChatToyTokenizer(VOCAB, eos_token_id=None), EngineConfig(speculative=spec), model_name=MODEL
    )
    with serve(engine) as s:
        client = s.client()
        for i in range(3):
            client.completions.create(
                model=MODEL, prompt="t1 t2 t1 t2 t1", max_tokens=20, temperature=1.0, seed=i
            )
        s.wait_for(lambda: s.metrics().get(("specverify_in_flight_requests", ())) == 0)
        m = s.metrics()
        drafter = ("drafter", "suffix")
        assert m[("specverify_drafter_info", (drafter,))] == 1.0
        assert m[("specverify_drafted_tokens_total", (("position", "0"),))] > 0
        assert 0.0 <= m[("specverify_estimator_ece", (drafter,))] <= 1.0
