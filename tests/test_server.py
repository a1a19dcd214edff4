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
import torch
from conftest import TEST_DEVICE
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
    speculative: bool = True,
    max_num_seqs: int = 16,
    delay: float = 0.0,
    max_model_len: int = 4096,
    logprobs_mode: str = "raw_logprobs",
) -> LLMEngine:
    target_fn = table_logits(VOCAB, 1, sharpness=2.0)
    noise_fn = table_logits(VOCAB, 2, sharpness=1.0)
    target = SlowToyRunner(VOCAB, target_fn, max_model_len=max_model_len, delay=delay, device=TEST_DEVICE)
    spec = None
    draft = None
    if speculative and HAS_ESTIMATOR:
        spec = SpeculativeConfig(num_speculative_tokens=3)
        draft = ToyRunner(
            VOCAB, lambda c: target_fn(c) + noise_fn(c), max_model_len=max_model_len, device=TEST_DEVICE
        )
    config = EngineConfig(max_num_seqs=max_num_seqs, speculative=spec, logprobs_mode=logprobs_mode)
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


def chat_body(**overrides) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3} | overrides


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


# ---- log-probabilities and n choices -----------------------------------------------------------------


def target_logprobs(engine: LLMEngine, context: list[int]) -> torch.Tensor:
    """The toy target's log-softmax after `context`: what every reported log-probability must be."""
    return torch.log_softmax(engine.target.logits_fn(tuple(context)).float(), dim=0)


def token_id(text: str) -> int:
    return int(text[1:])  # the toy tokenizer renders id i as "ti"


def check_legacy_logprobs(
    engine: LLMEngine, logprobs, context: list[int], top: int, first_offset: int = 0
) -> None:
    """Completions' logprobs, position by position (`context` leads up to the first listed token)."""
    tokens = logprobs.tokens
    assert logprobs.text_offset == [first_offset + sum(map(len, tokens[:k])) for k in range(len(tokens))]
    context = list(context)
    for text, logprob, alternatives in zip(
        tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        token, truth = token_id(text), target_logprobs(engine, context)
        assert logprob == pytest.approx(float(truth[token]), abs=1e-4)
        best = torch.topk(truth, top).indices.tolist() if top else []
        assert {token_id(t) for t in alternatives} == {token} | set(best)  # the chosen token and the top N
        for t, value in alternatives.items():
            assert value == pytest.approx(float(truth[token_id(t)]), abs=1e-4)
        context.append(token)


def check_chat_logprobs(engine: LLMEngine, content, context: list[int], top: int) -> None:
    context = list(context)
    for entry in content:
        token, truth = token_id(entry.token), target_logprobs(engine, context)
        assert entry.logprob == pytest.approx(float(truth[token]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert [token_id(e.token) for e in entry.top_logprobs] == torch.topk(truth, top).indices.tolist()
        for e in entry.top_logprobs:
            assert e.logprob == pytest.approx(float(truth[token_id(e.token)]), abs=1e-4)
        context.append(token)


def test_completion_logprobs_are_the_targets_greedy_sampled_and_streamed() -> None:
    engine = make_engine()
    with serve(engine) as s:
        client = s.client()
        prompt = [1, 2, 3]
        greedy = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
        )
        choice = greedy.choices[0]
        assert len(choice.logprobs.tokens) == 8 and " ".join(choice.logprobs.tokens) == choice.text
        check_legacy_logprobs(engine, choice.logprobs, prompt, 3)
        context = list(prompt)
        for text in choice.logprobs.tokens:  # greedy: each token is the target's most likely
            assert token_id(text) == int(target_logprobs(engine, context).argmax())
            context.append(token_id(text))

        # Sampled: still the raw target distribution (before temperature, top-k, top-p).
        sampled = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0.7, top_p=0.9, seed=5, logprobs=2
        )
        check_legacy_logprobs(engine, sampled.choices[0].logprobs, prompt, 2)
        # logprobs 0 (as vLLM): each position lists the chosen token alone.
        zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
        assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == [
            [t] for t in zero.choices[0].logprobs.tokens
        ]
        assert zero.choices[0].logprobs.tokens == choice.logprobs.tokens[:4]

        # Streamed: each chunk carries its own tokens, offsets run on, and the whole is the same.
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True
            )
        )
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == choice.logprobs.tokens
        assert [v for p in parts for v in p.token_logprobs] == choice.logprobs.token_logprobs
        assert [o for p in parts for o in p.text_offset] == choice.logprobs.text_offset
        assert [t for p in parts for t in p.top_logprobs] == choice.logprobs.top_logprobs
        assert "".join(c.choices[0].text for c in chunks) == choice.text

        # A stop string cuts the text; the tokens end with the one that completed it (the toy tokenizer
        # joins tokens with spaces: the second token completes " "), as plain decoding would stop,
        # however many drafts a step accepted; usage counts the same tokens.
        stopped = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[" "], logprobs=1
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].logprobs.tokens == [stopped.choices[0].text] * 2
        assert stopped.usage.completion_tokens == 2
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[" "], logprobs=1, stream=True
            )
        )
        assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == (
            stopped.choices[0].logprobs.tokens
        )
        # No logprobs asked: none sent.
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].logprobs is None


def test_speculation_does_not_change_logprobs() -> None:
    answers = []
    for speculative in (False, True):
        with serve(make_engine(speculative=speculative)) as s:
            r = s.client().completions.create(
                model=MODEL, prompt="t4 t9", max_tokens=24, temperature=0, logprobs=4, echo=True
            )
            answers.append(r.choices[0].logprobs)
    plain, speculated = answers
    assert speculated.tokens == plain.tokens
    assert speculated.token_logprobs[1:] == pytest.approx(plain.token_logprobs[1:], abs=1e-5)


def test_echo_scores_the_prompt() -> None:
    engine = make_engine()
    with serve(engine) as s, httpx.Client(timeout=10) as http:
        client = s.client()
        prompt = [5, 9, 2, 17, 30]
        # Prompt scoring as lm-evaluation-harness asks it: echo + logprobs + max_tokens 0.
        scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        choice = scored.choices[0]
        assert choice.text == "t5 t9 t2 t17 t30" and choice.finish_reason == "length"
        assert scored.usage.prompt_tokens == 5 and scored.usage.completion_tokens == 0
        lp = choice.logprobs
        assert [token_id(t) for t in lp.tokens] == prompt
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
        assert lp.text_offset == [0, 2, 4, 6, 9]
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            setattr(lp, field, getattr(lp, field)[1:])
        check_legacy_logprobs(engine, lp, prompt[:1], 2, first_offset=2)
        # The raw body: the nulls are JSON nulls.
        raw = http.post(
            f"{s.url}/v1/completions",
            json=completion_body(prompt="t5 t9", max_tokens=0, echo=True, logprobs=0),
        ).json()["choices"][0]
        assert raw["text"] == "t5 t9" and raw["logprobs"]["token_logprobs"][0] is None
        assert raw["logprobs"]["top_logprobs"] == [None, {"t9": raw["logprobs"]["token_logprobs"][1]}]

        # Echo with generation: the prompt's tokens, then the completion's; text_offset runs on.
        both = client.completions.create(
            model=MODEL, prompt="t5 t9 t2", max_tokens=4, temperature=0, echo=True, logprobs=1
        )
        lp = both.choices[0].logprobs.model_copy()  # trimmed below, compared whole later
        assert len(lp.tokens) == 7 and both.choices[0].text.startswith("t5 t9 t2")
        assert [token_id(t) for t in lp.tokens[:3]] == [5, 9, 2] and lp.token_logprobs[0] is None
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            setattr(lp, field, getattr(lp, field)[1:])
        check_legacy_logprobs(engine, lp, [5], 1, first_offset=2)
        # Echo without logprobs: the prompt's text in front only.
        plain = client.completions.create(model=MODEL, prompt="t5 t9", max_tokens=3, temperature=0, echo=True)
        assert plain.choices[0].text.startswith("t5 t9") and plain.choices[0].logprobs is None
        # Streamed: the echoed prompt comes first, with its log-probabilities.
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="t5 t9 t2",
                max_tokens=4,
                temperature=0,
                echo=True,
                logprobs=1,
                stream=True,
            )
        )
        assert chunks[0].choices[0].text == "t5 t9 t2"
        assert chunks[0].choices[0].logprobs.tokens == ["t5", "t9", "t2"]
        assert "".join(c.choices[0].text for c in chunks) == both.choices[0].text
        assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == (
            both.choices[0].logprobs.tokens
        )


def test_chat_logprobs_streamed_and_not() -> None:
    engine = make_engine()
    with serve(engine) as s:
        client = s.client()
        messages = [{"role": "user", "content": "t5 t6"}]
        context = [4, 5, 6, 0]  # the toy chat template: "t4 t5 t6 t0"
        whole = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
        )
        content = whole.choices[0].logprobs.content
        assert " ".join(e.token for e in content) == whole.choices[0].message.content
        check_chat_logprobs(engine, content, context, 3)
        sampled = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=1.0,
            seed=2,
            logprobs=True,
            top_logprobs=2,
        )
        check_chat_logprobs(engine, sampled.choices[0].logprobs.content, context, 2)
        # logprobs without top_logprobs: each token's own, no alternatives.
        bare = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True
        )
        assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], [], []]
        assert [e.logprob for e in bare.choices[0].logprobs.content] == [e.logprob for e in content[:3]]
        off = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=False)
        assert off.choices[0].logprobs is None

        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
        streamed = []
        for chunk in stream:
            lp = chunk.choices[0].logprobs
            if lp is not None:  # the tokens of this delta, and only those
                assert " ".join(e.token for e in lp.content) == chunk.choices[0].delta.content.strip()
                streamed += lp.content
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_n_choices_are_independent_samples_with_their_own_logprobs_and_usage() -> None:
    engine = make_engine()
    with serve(engine) as s:
        client = s.client()
        prompt = [3, 1]
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4, logprobs=1
        )
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert len({c.text for c in r.choices}) > 1  # independent samples, not copies
        for c in r.choices:  # each choice's logprobs follow its own text
            assert " ".join(c.logprobs.tokens) == c.text and c.finish_reason == "length"
            check_legacy_logprobs(engine, c.logprobs, prompt, 1)
        assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 48 and r.usage.total_tokens == 50
        again = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4, logprobs=1
        )
        assert [c.text for c in again.choices] == [c.text for c in r.choices]  # a seed repeats all n
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, best_of=2).choices

        # Streamed: chunks name their choice, each choice ends with its own finish chunk, usage sums all.
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=12,
                temperature=1.0,
                seed=11,
                n=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        texts = {
            i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(4)
        }
        assert [texts[i] for i in range(4)] == [c.text for c in r.choices]
        finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
        assert sorted(finishes) == [0, 1, 2, 3]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48

        # Chat: n choices, each with its own finish reason (here one stops on a stop token).
        messages = [{"role": "user", "content": "t7"}]
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=4, n=3, logprobs=True
        )
        assert [c.index for c in chat.choices] == [0, 1, 2]
        assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
        # A stop token ends the choices that draw it and no other (the same seed draws the same samples).
        stop = token_id(chat.choices[0].logprobs.content[0].token)
        drawn = [[token_id(e.token) for e in c.logprobs.content] for c in chat.choices]
        mixed = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=1.0,
            seed=4,
            n=3,
            extra_body={"stop_token_ids": [stop]},
        )
        assert [c.finish_reason for c in mixed.choices] == ["stop" if stop in d else "length" for d in drawn]
        kept = [d.index(stop) + 1 if stop in d else len(d) for d in drawn]
        assert mixed.usage.completion_tokens == sum(kept)
        role_chunks = 0
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=1.0, seed=4, n=3, stream=True
        ):
            role_chunks += chunk.choices[0].delta.role == "assistant"
        assert role_chunks == 3
        s.wait_for(lambda: s.worker.in_flight == 0)
        m = s.metrics()
        # One finished request per HTTP request, however many choices it had.
        assert sum(v for (name, _), v in m.items() if name == "specverify_requests_finished_total") == 7


def test_n_choices_abort_together_when_the_client_leaves() -> None:
    with serve(make_engine(delay=0.01), max_queue=4) as s:
        with httpx.Client(timeout=10) as http:
            body = completion_body(max_tokens=500, n=3, temperature=1.0, stream=True)
            with http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                assert s.worker.in_flight == 3  # counted in samples, as the engine's running slots are
        s.wait_for(lambda: s.worker.in_flight == 0)
        s.wait_for(lambda: s.metrics()[("specverify_running_requests", ())] == 0)
        assert s.metrics()[("specverify_requests_finished_total", (("finish_reason", "abort"),))] == 1
        ok = httpx.post(f"{s.url}/v1/completions", json=completion_body(n=2), timeout=5)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 10


def test_processed_logprobs_send_minus_infinity_as_minus_9999() -> None:
    with serve(make_engine(logprobs_mode="processed_logprobs")) as s, httpx.Client(timeout=10) as http:
        r = http.post(
            f"{s.url}/v1/completions",
            json=completion_body(max_tokens=6, temperature=1.0, top_p=0.05, seed=1, logprobs=5),
        )
        assert r.status_code == 200, r.text
        lp = json.loads(r.text)["choices"][0]["logprobs"]  # plain JSON: no Infinity in it
        assert lp["token_logprobs"] == [0.0] * 6  # top_p 0.05 keeps the top token alone
        assert all(sorted(top.values())[0] == -9999.0 for top in lp["top_logprobs"])
        chat = s.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            temperature=1.0,
            top_p=0.05,
            logprobs=True,
            top_logprobs=4,
        )
        assert [e.logprob for e in chat.choices[0].logprobs.content[0].top_logprobs][1:] == [-9999.0] * 3


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
    ("n over the limit", "/v1/completions", completion_body(n=17), 400, "n", None),
    ("n zero", "/v1/completions", completion_body(n=0), 400, "n", None),
    ("best_of other than n", "/v1/completions", completion_body(n=2, best_of=3), 400, "best_of", None),
    ("logprobs over 20", "/v1/completions", completion_body(logprobs=21), 400, "logprobs", None),
    ("negative logprobs", "/v1/completions", completion_body(logprobs=-1), 400, "logprobs", None),
    ("logprobs not an integer", "/v1/completions", completion_body(logprobs=True), 400, "logprobs", None),
    ("logprobs a string", "/v1/completions", completion_body(logprobs="5"), 400, "logprobs", None),
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
    ("chat n over the limit", "/v1/chat/completions", chat_body(n=17), 400, "n", None),
    ("chat echo", "/v1/chat/completions", chat_body(echo=True), 400, "echo", None),
    ("chat max_tokens zero", "/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens", None),
    (
        "top_logprobs over 20",
        "/v1/chat/completions",
        chat_body(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        None,
    ),
    (
        "negative top_logprobs",
        "/v1/chat/completions",
        chat_body(logprobs=True, top_logprobs=-1),
        400,
        "top_logprobs",
        None,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        chat_body(top_logprobs=2),
        400,
        "top_logprobs",
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
    engine.target = FailingRunner(VOCAB, engine.target.logits_fn, device=TEST_DEVICE)
    with serve(engine) as s, httpx.Client(timeout=5) as http:
        r = http.post(f"{s.url}/v1/completions", json=completion_body(prompt=[31, 1]))
        assert "simulated kernel failure" in assert_error(r, 500)
        good = http.post(f"{s.url}/v1/completions", json=completion_body(prompt=[1, 2]))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
        assert s.worker.failed_steps == 1 and s.worker.in_flight == 0


def test_serve_subcommand_is_registered(monkeypatch) -> None:
    from specverify.cli import build_parser
    from specverify.server import cli as serve_cli
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
            "--logprobs-mode",
            "processed_logprobs",
        ]
    )
    assert args.func is run and args.port == 9 and args.max_queue == 3 and args.estimator_state == "e.json"
    assert build_parser().parse_args(["serve", "--model", "m.gguf"]).logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--logprobs-mode", "softmax"])
    # The mode reaches the engine's config through LLM(...): stop where the models would load.
    seen = {}

    def fake_llm_from_args(args, **kwargs):
        seen.update(kwargs)
        raise SystemExit("stop before loading")

    monkeypatch.setattr(serve_cli, "llm_from_args", fake_llm_from_args)
    args.estimator_state = None
    with pytest.raises(SystemExit, match="stop before loading"):
        run(args)
    assert seen["logprobs_mode"] == "processed_logprobs"
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
def test_real_model_chat_over_http(smollm2_gguf, specverify_cache, device) -> None:
    from specverify.models.loader import load_model, load_tokenizer
    from specverify.models.runner import TorchModelRunner

    # One load serves as target and draft (separate KV caches over shared weights): loading is the slow part.
    model, config = load_model(smollm2_gguf, dtype="bfloat16", device=device, progress=False)
    target = TorchModelRunner(model, config, device=device, dtype="bfloat16", max_model_len=256)
    draft = TorchModelRunner(model, config, device=device, dtype="bfloat16", max_model_len=256)
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


def test_a_suffix_drafting_server_names_its_drafter_in_the_metrics(device) -> None:
    target = SlowToyRunner(VOCAB, table_logits(VOCAB, 1, sharpness=2.0), device=device)
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
