"""OpenAI-compatible HTTP API over the speculative engine: completions, chat completions, models, metrics.

Handlers validate everything they can before a request reaches the engine (JSON, model name, sampling
parameters, prompt length), so bad requests get a 4xx in OpenAI's error shape at once and never disturb
the running batch. Accepted requests go to the single engine thread (`worker.py`); each handler reads its
request's outputs from its own asyncio queue and answers in one piece or as server-sent events.

`n` choices are the engine's n samples of the prompt. Log-probabilities come from the engine
(`logprobs.py`: the target's, exact under speculation) and are shaped here: completions' legacy
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, with `echo` the prompt's tokens first;
chat's `logprobs.content`. -inf (processed mode, tokens cut by top-p) is sent as -9999.0, as vLLM does,
since JSON has no infinity.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specverify.engine.sequence import RequestOutput
from specverify.logprobs import Logprob, PositionLogprobs
from specverify.sampling_params import SamplingParams
from specverify.server.metrics import EngineCollector, ServerMetrics
from specverify.server.worker import EngineWorker, Failure, QueueFull, ShuttingDown, Submission

logger = logging.getLogger("specverify.server")

# OpenAI's legacy completions endpoint generates 16 tokens when max_tokens is not given.
_DEFAULT_COMPLETION_TOKENS = 16
# How often a non-streaming handler checks whether its client is still there.
_DISCONNECT_POLL_S = 0.5
_KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# JSON has no -inf: a log-probability of a token that cannot be drawn is sent as this (vLLM's value).
_LOGPROB_FLOOR = -9999.0


# ---- errors -----------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ---- request schemas --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's)
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension
    stop_token_ids: list[int] | None = None  # extension


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: StrictInt | None = None  # strict: `true` (the chat field's type) is a mistake, not 1
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = None
    echo: Any = None  # not a chat field: declared only so that it can be refused
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise APIError(
            400, f"invalid value for '{where}': {first.get('msg', 'invalid')}", param=param
        ) from None


async def _read_json(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


# ---- the app ----------------------------------------------------------------------------------------


class ServerContext:
    """What the handlers share: the worker, the tokenizer, the served name, the metrics."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: Any,
        model_name: str,
        metrics: ServerMetrics,
        shutdown_timeout: float,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.shutdown_timeout = shutdown_timeout
        self.created = int(time.time())
        self.aliases: set[str] = set()  # other names clients may use for the served model


def create_app(
    engine: Any,
    tokenizer: Any = None,
    *,
    served_model_name: str | None = None,
    max_queue: int = 256,
    estimator_state: str | None = None,
    shutdown_timeout: float = 30.0,
    model_aliases: tuple[str, ...] = (),
    estimator_checkpoint_interval: float = 60.0,
    estimator_state_reset: bool = False,
) -> FastAPI:
    """Build the app around an engine. The engine thread starts and stops with the app's lifespan.

    `estimator_state`: a JSON file the estimator is restored from at start (when it exists), written every
    `estimator_checkpoint_interval` seconds (0: never) and at shutdown; `estimator_state_reset` starts cold
    and overwrites it. `shutdown_timeout`: how long in-flight requests may run once shutdown begins.
    `model_aliases`: names accepted in requests besides the served name (e.g. the model's path).
    """
    metrics = ServerMetrics()
    worker = EngineWorker(
        engine,
        max_queue=max_queue,
        estimator_state=estimator_state,
        metrics=metrics,
        checkpoint_interval=estimator_checkpoint_interval,
        reset_estimator_state=estimator_state_reset,
    )
    metrics.registry.register(EngineCollector(worker.snapshot))
    ctx = ServerContext(
        worker,
        tokenizer if tokenizer is not None else engine.tokenizer,
        served_model_name or getattr(engine, "model_name", None) or "specverify",
        metrics,
        shutdown_timeout,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            # Joining the engine thread blocks; keep the event loop free to deliver the last outputs.
            await asyncio.to_thread(worker.shutdown, ctx.shutdown_timeout)

    ctx.aliases.update(a for a in model_aliases if a)
    app = FastAPI(title="specverify", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(
            exc.status_code, f"{exc.detail} ({request.method} {request.url.path})", code=code
        ).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not worker.alive:
            return APIError(503, "the engine thread is not running", type="service_unavailable").response()
        if not worker.accepting:
            return APIError(503, "the server is shutting down", type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(ctx, model_id)
        return _model_card(ctx)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: CompletionRequest = _parse(CompletionRequest, await _read_json(request))
        _check_model(ctx, req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(
                400,
                "best_of must equal n (extra samples are not ranked, each sample is a choice)",
                param="best_of",
            )
        prompt = _single_prompt(req.prompt)
        prompt_ids = _completion_prompt_ids(ctx, prompt)
        # echo + logprobs scores the prompt too (lm-evaluation-harness asks it with max_tokens 0).
        scored = {"logprobs": req.logprobs, "prompt_logprobs": req.logprobs if req.echo else None}
        params = _sampling_params(
            ctx,
            req,
            len(prompt_ids),
            req.max_tokens,
            _DEFAULT_COMPLETION_TOKENS,
            "prompt",
            prefill_only=bool(req.echo),
            **scored,
        )
        echo = None
        if req.echo:
            echo = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids)
        job = _Job(ctx, "cmpl", prompt_ids, params, arrival, chat=False, echo=echo, top_logprobs=req.logprobs)
        return await job.respond(request, stream=bool(req.stream), include_usage=_include_usage(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _read_json(request))
        _check_model(ctx, req.model)
        if req.echo not in (None, False):
            raise APIError(
                400, "echo is not a chat completions parameter (use /v1/completions)", param="echo"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        prompt_ids = _chat_prompt_ids(ctx, req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(
            ctx,
            req,
            len(prompt_ids),
            max_tokens,
            None,
            "messages",
            max_tokens_param=param,
            aliases={"logprobs": "top_logprobs"},
            logprobs=top_logprobs,
        )
        job = _Job(ctx, "chatcmpl", prompt_ids, params, arrival, chat=True, top_logprobs=top_logprobs)
        return await job.respond(request, stream=bool(req.stream), include_usage=_include_usage(req))

    return app


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (it never touches `receive`, so
    streaming responses still see client disconnects)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = (
            path
            if path in _KNOWN_ENDPOINTS
            else ("/v1/models" if path.startswith("/v1/models/") else "other")
        )

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "specverify",
        "max_model_len": ctx.worker.max_model_len,
    }


def _check_model(ctx: ServerContext, name: str | None) -> None:
    # No model given: the one served (lenient, like most single-model servers).
    if name is not None and name != ctx.model_name and name not in ctx.aliases:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{ctx.model_name}'",
            param="model",
            code="model_not_found",
        )


def _include_usage(req: _GenerationRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---- prompts ----------------------------------------------------------------------------------------


def _single_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a request: a string or token ids (a batch of one is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400, "only one prompt per request is supported; send several requests", param="prompt"
            )
        prompt = prompt[0]
    return prompt


def _completion_prompt_ids(ctx: ServerContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = list(ctx.tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < ctx.worker.vocab_size]
        if bad:
            raise APIError(
                400, f"prompt token ids out of range [0, {ctx.worker.vocab_size}): {bad[:5]}", param="prompt"
            )
    _check_prompt_length(ctx, ids, "prompt")
    return ids


def _chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage]) -> list[int]:
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400, f"messages[{i}]: only text content parts are supported", param="messages"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        plain.append({"role": m.role, "content": content or ""})
    try:
        text = ctx.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # template errors (e.g. roles that must alternate) are the request's fault
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    ids = list(ctx.tokenizer.encode(text, add_special_tokens=False))
    _check_prompt_length(ctx, ids, "messages")
    return ids


def _check_prompt_length(ctx: ServerContext, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token", param=param)
    limit = ctx.worker.max_model_len
    if len(ids) >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but the prompt has {len(ids)} tokens "
            f"(at most {limit - 1}, to leave room for one generated token)",
            param=param,
            code="context_length_exceeded",
        )


# ---- sampling parameters ----------------------------------------------------------------------------


def _sampling_params(
    ctx: ServerContext,
    req: _GenerationRequest,
    prompt_len: int,
    max_tokens: int | None,
    default_max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
    prefill_only: bool = False,
    aliases: dict[str, str] | None = None,
    **extra: Any,
) -> SamplingParams:
    """SamplingParams from the request's fields plus `extra` (more SamplingParams fields). `prefill_only`
    allows max_tokens 0 (prompt scoring); `aliases` name the request field a SamplingParams error is about."""
    lowest = 0 if prefill_only else 1
    if max_tokens is not None and max_tokens < lowest:
        raise APIError(
            400, f"{max_tokens_param} must be at least {lowest}, got {max_tokens}", param=max_tokens_param
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    room = ctx.worker.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens >= 1 and max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {ctx.worker.max_model_len} tokens, but {prompt_len + max_tokens} "
            f"were requested ({prompt_len} in the prompt, {max_tokens} for the completion); lower {max_tokens_param}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    logit_bias: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token < ctx.worker.vocab_size:
            raise APIError(400, f"logit_bias token id {token} is out of the vocabulary", param="logit_bias")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        logit_bias[token] = bias
    stop_token_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < ctx.worker.vocab_size for t in stop_token_ids):
        raise APIError(400, "stop_token_ids must be token ids in the vocabulary", param="stop_token_ids")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise APIError(400, "at most 4 stop sequences are supported", param="stop")
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": stop,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": stop_token_ids,
        "logit_bias": logit_bias,
        "n": 1 if req.n is None else req.n,
        **extra,
    }
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        param = {"max_tokens": max_tokens_param, **(aliases or {})}.get(field, field)
        if field != param:
            message = f"{param}{message[len(field) :]}"
        raise APIError(400, message, param=param if field in kwargs else None) from None


# ---- one generation request -------------------------------------------------------------------------


class _TextStream:
    """Turns the engine's decoded-so-far text into deltas that are safe to send.

    Holds back a trailing U+FFFD (a multi-byte character not yet complete) and, when stop strings are set,
    the last `len(stop) - 1` characters, which could still turn out to begin a stop string the engine will
    cut off.
    """

    def __init__(self, stop: list[str]) -> None:
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            end = len(text)
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            text = text[: max(end - self.hold, 0)]
        if len(text) <= len(self.sent):
            return ""
        # Decoding only appends in practice; if a tokenizer ever rewrites earlier text, sent text cannot be
        # taken back, so the stream continues from the same character count.
        piece = text[len(self.sent) :]
        self.sent = text
        return piece


# One scored token: its id and its entries (None: no log-probability, the prompt's first token).
_Scored = tuple[int, PositionLogprobs | None]


@dataclass
class _Choice:
    """One of the request's n choices (one engine sample): its final output and what has been streamed."""

    text: _TextStream
    final: RequestOutput | None = None
    echoed: bool = False  # the prompt has been streamed in front of it
    sent_tokens: int = 0  # output tokens whose log-probabilities have been streamed
    offset: int = 0  # text_offset of the next token (completions' logprobs)


class _Job:
    """One request from submission to answer: its n choices, in one piece or as server-sent events.

    `echo`: the prompt's text, put in front of each choice's (completions). `top_logprobs`: how many
    alternatives per token the answer lists (None: no logprobs in the answer).
    """

    def __init__(
        self,
        ctx: ServerContext,
        prefix: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        chat: bool,
        echo: str | None = None,
        top_logprobs: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival = arrival
        self.chat = chat
        self.echo = echo
        self.top_logprobs = top_logprobs
        self.choices = [_Choice(_TextStream(params.stop)) for _ in range(params.n)]
        self.created = int(time.time())
        self.first_token = False
        self.done = False

    async def respond(self, request: Request, stream: bool, include_usage: bool) -> Response:
        ctx = self.ctx
        self.outputs: asyncio.Queue = asyncio.Queue()
        submission = Submission(
            self.id, self.prompt_ids, self.params, asyncio.get_running_loop(), self.outputs, stream=stream
        )
        try:
            ctx.worker.submit(submission)
        except QueueFull as e:
            raise APIError(
                429,
                f"{e}; retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), type="service_unavailable", code="shutting_down") from None
        ctx.metrics.prompt_tokens.inc(len(self.prompt_ids))
        if stream:
            return StreamingResponse(
                self._events(include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            failure = await self._wait_final(request)
        finally:
            if not self.done:  # cancelled, or the client left: free the slot
                ctx.worker.abort(self.id)
        if failure is not None:
            raise APIError(failure.status, failure.message, type=failure.type)
        return JSONResponse(self._full_response())

    def _seen(self, item: RequestOutput | Failure) -> None:
        metrics = self.ctx.metrics
        if isinstance(item, Failure):
            self.done = True
            return
        if not self.first_token and item.output_token_ids:
            self.first_token = True
            metrics.time_to_first_token.observe(time.perf_counter() - self.arrival)
        if item.finished:
            self.choices[item.index].final = item
            if all(c.final is not None for c in self.choices):
                self.done = True
                metrics.request_latency.observe(time.perf_counter() - self.arrival)

    async def _wait_final(self, request: Request) -> Failure | None:
        """Wait until every choice has finished (None) or the request failed (the failure)."""
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        while True:
            try:
                item = await asyncio.wait_for(self.outputs.get(), timeout=_DISCONNECT_POLL_S)
            except TimeoutError:
                pass
            else:
                self._seen(item)
                if self.done:
                    return item if isinstance(item, Failure) else None
            # Checked on a clock, not only on quiet spells: outputs may keep arriving while the client is gone.
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    raise _ClientGone()
                next_check = time.monotonic() + _DISCONNECT_POLL_S

    def _usage(self) -> dict[str, int]:
        # The prompt is counted once (it is prefilled once), every choice's tokens count.
        n_out = sum(len(c.final.output_token_ids) for c in self.choices)
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(self.prompt_ids) + n_out,
        }

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }

    # ---- whole answers ----

    def _full_response(self) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        body = self._envelope(kind, [self._full_choice(c) for c in self.choices])
        body["usage"] = self._usage()
        return body

    def _full_choice(self, choice: _Choice) -> dict[str, Any]:
        out = choice.final
        reason = out.finish_reason or "stop"
        logprobs = None
        if self.top_logprobs is not None:
            tokens = self._output_tokens(out, 0, len(out.output_token_ids))
            if self.echo is not None:
                tokens = self._prompt_tokens(out) + tokens
            logprobs = self._logprobs(choice, tokens)
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            return {"index": out.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        text = (self.echo or "") + out.text
        return {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    # ---- streams ----

    def _chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        role: bool = False,
    ) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return _sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return _sse(self._envelope("text_completion", [choice]))

    def _choice_chunks(self, out: RequestOutput) -> Iterator[str]:
        """The chunks one sample's output adds: the echoed prompt first, then its new text with the
        log-probabilities of the tokens behind it and, at its end, its finish chunk."""
        choice = self.choices[out.index]
        if self.echo is not None and not choice.echoed:
            choice.echoed = True
            logprobs = None if self.top_logprobs is None else self._logprobs(choice, self._prompt_tokens(out))
            yield self._chunk(out.index, self.echo, None, logprobs)
        piece = choice.text.delta(out.text, out.finished)
        # New tokens go out with the next piece of text (or at the end): a token that is only part of a
        # character waits for it. A token whose text the stream still holds back (it may begin a stop
        # string) can go one chunk ahead of its text.
        if piece or out.finished:
            upto = len(out.output_token_ids)
            tokens = self._output_tokens(out, choice.sent_tokens, upto)
            choice.sent_tokens = max(choice.sent_tokens, upto)
            logprobs = self._logprobs(choice, tokens) if tokens else None
            if piece or logprobs:
                yield self._chunk(out.index, piece, None, logprobs)
        if out.finished:
            yield self._chunk(out.index, None, out.finish_reason or "stop")

    async def _events(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                for index in range(len(self.choices)):
                    yield self._chunk(index, None, None, role=True)
            while not self.done:
                item = await self.outputs.get()
                self._seen(item)
                if isinstance(item, Failure):
                    yield _sse(APIError(item.status, item.message, type=item.type).body())
                    break
                for chunk in self._choice_chunks(item):
                    yield chunk
                if self.done and include_usage:
                    kind = "chat.completion.chunk" if self.chat else "text_completion"
                    yield _sse(self._envelope(kind, []) | {"usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            # Reached on normal ends and when Starlette cancels the stream because the client disconnected.
            if not self.done:
                self.ctx.worker.abort(self.id)

    # ---- log-probabilities ----

    def _output_tokens(self, out: RequestOutput, start: int, end: int) -> list[_Scored]:
        if self.top_logprobs is None:
            return []
        return list(zip(out.output_token_ids[start:end], out.logprobs[start:end], strict=True))

    @staticmethod
    def _prompt_tokens(out: RequestOutput) -> list[_Scored]:
        return list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True))

    def _logprobs(self, choice: _Choice, tokens: list[_Scored]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_logprob(token, entries) for token, entries in tokens]}
        return self._legacy_logprobs(choice, tokens)

    def _legacy_logprobs(self, choice: _Choice, tokens: list[_Scored]) -> dict[str, Any]:
        """Completions' shape. top_logprobs as vLLM gives them: the chosen token and the `logprobs` best
        (so `logprobs: 0` lists the chosen token alone). Offsets run on over the choice's tokens."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entries in tokens:
            text = self._token_text(token, entries[token] if entries else None)
            out["tokens"].append(text)
            out["text_offset"].append(choice.offset)
            choice.offset += len(text)
            if entries is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_json_logprob(entries[token].logprob))
            out["top_logprobs"].append(
                {self._token_text(t, lp): _json_logprob(lp.logprob) for t, lp in entries.items()}
            )
        return out

    def _chat_logprob(self, token: int, entries: PositionLogprobs) -> dict[str, Any]:
        """Chat's shape: the token and the `top_logprobs` most likely tokens by rank (the chosen token is
        among them only when it ranks that high)."""
        n = self.top_logprobs
        top = sorted((e for e in entries.items() if e[1].rank <= n), key=lambda e: e[1].rank)[:n]
        entry = self._chat_entry(token, entries[token])
        entry["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in top]
        return entry

    def _chat_entry(self, token: int, lp: Logprob) -> dict[str, Any]:
        text = self._token_text(token, lp)
        return {"token": text, "logprob": _json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

    def _token_text(self, token: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.ctx.tokenizer.decode([token], skip_special_tokens=False)


def _json_logprob(value: float) -> float:
    # -inf (and NaN) have no JSON form; vLLM sends -9999.0.
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR


class _ClientGone(Exception):
    pass


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- running it -------------------------------------------------------------------------------------


class SpecverifyServer(uvicorn.Server):
    """uvicorn's server, told to drain the engine as soon as a shutdown signal arrives.

    On SIGINT/SIGTERM the worker stops taking requests and gives in-flight ones `shutdown_timeout` seconds
    to finish before ending them with an error; uvicorn waits a little longer than that for connections
    to close, then the app's lifespan stops the engine thread and saves the estimator.
    """

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
    ) -> None:
        ctx: ServerContext = app.state.ctx
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=ctx.shutdown_timeout + 5.0,
        )
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.ctx.worker.begin_drain(self.ctx.shutdown_timeout)
        super().handle_exit(sig, frame)

    def request_shutdown(self) -> None:
        """The same as a SIGTERM, for callers that run the server in a thread (tests, embedding)."""
        self.ctx.worker.begin_drain(self.ctx.shutdown_timeout)
        self.should_exit = True
