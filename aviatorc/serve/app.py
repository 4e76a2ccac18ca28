"""The OpenAI-compatible HTTP API over the tenants' engines (FastAPI; SSE by sse-starlette).

    POST /v1/completions        prompt as text (needs a tokenizer) or token ids; one choice per prompt
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the artifacts served, and their LoRA adapters (`parent`: the artifact)
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"}: a PEFT adapter beside the first artifact
    POST /v1/unload_lora_adapter {"lora_name"}              (both with --enable-lora, as vLLM's)
    GET  /health                200 while every engine runs
    GET  /metrics               Prometheus text format

Streaming sends `data: {chunk}` events, `finish_reason` on each choice's last one, a usage
chunk when `stream_options.include_usage`, then `data: [DONE]`. Each choice carries its
`token_ids` when `return_token_ids` is true, and always for a model without a tokenizer (its
`text` is then empty). Log-probabilities, when asked, in OpenAI's shapes: completions'
`{tokens, token_logprobs, top_logprobs, text_offset}` (offsets into the choice's text), chat's
`{content: [{token, logprob, bytes, top_logprobs}]}`, each chunk of a stream with its tokens';
a token is its text as the tokenizer decodes it alone, or `token_id:N` without a tokenizer. Errors use OpenAI's body: `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request (a body that is not UTF-8 or not JSON among them), 404 for an unknown model
or path, 413 for a body over `--max-request-bytes`, 429 for a full queue, 503 while the server
shuts down, 504 for a timeout.

Bodies are parsed in a worker thread, so a large one never stalls the event loop (`/health` keeps
answering). While the server drains (SIGTERM, `aviatorc.serve.server`), new generation requests
get 503 and `/health` answers 503 `draining`; the requests already accepted run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from aviatorc.errors import AviatorError
from aviatorc.runtime.sampling import Logprobs
from aviatorc.serve.engine import Finished, GenerationRequest, QueueFull, Token
from aviatorc.serve.metrics import Registry
from aviatorc.serve.protocol import (
    Body,
    Bounds,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    TextStream,
    error_body,
    parse_request,
)
from aviatorc.serve.tenants import ServedModel

_STATUS = {"timeout": 504, "error": 500, "cancelled": 499, "shutdown": 503}  # a request's end -> its HTTP status
log = logging.getLogger("aviatorc.serve")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self.status, self.message, self.kind = status, message, kind
        super().__init__(message)


def _ended(end: Finished) -> tuple[int, dict[str, Any]]:
    """The status and error body of a request that ended without its tokens."""
    status = _STATUS[end.reason]
    kind = {"timeout": "timeout_error", "shutdown": "service_unavailable_error"}.get(end.reason, "server_error")
    return status, error_body(status, end.message or end.reason, kind)


def create_app(models: dict[str, ServedModel], registry: Registry) -> FastAPI:
    """The app; its lifespan starts one engine task per model and stops them on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(m.engine.run(), name=f"engine {m.name}") for m in models.values()]
        app.state.tasks = tasks
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="aviatorc", lifespan=lifespan)
    app.state.draining = False

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, error: HTTPError) -> JSONResponse:
        return JSONResponse(error_body(error.status, error.message, error.kind), status_code=error.status)

    @app.exception_handler(AviatorError)
    async def _user_error(request: Request, error: AviatorError) -> JSONResponse:
        return JSONResponse(error_body(400, str(error), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}: {error}", "server_error"),
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in error.errors())
        return JSONResponse(error_body(400, problems or "invalid request", "invalid_request_error"), status_code=400)

    @app.exception_handler(HTTPException)
    async def _routing(request: Request, error: HTTPException) -> JSONResponse:  # an unknown path, a wrong method
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind),
                            status_code=error.status_code, headers=error.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        dead = [t.get_name() for t in getattr(app.state, "tasks", []) if t.done()]
        if dead:
            return JSONResponse({"status": "error", "stopped": dead}, status_code=503)
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(registry.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        listed = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "aviatorc",
                   "max_model_len": m.session.context, "max_num_seqs": m.engine.slots} for m in models.values()]
        listed += [{"id": name, "object": "model", "created": m.created, "owned_by": "aviatorc", "parent": m.name,
                    "root": adapter.path, "max_model_len": m.session.context, "max_num_seqs": m.engine.slots}
                   for m in models.values() if m.session.adapters is not None
                   for name, adapter in sorted(m.session.adapters.loaded.items())]
        return {"object": "list", "data": listed}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> JSONResponse:
        model, fields = _lora_request(models, await raw.body(), ("lora_name", "lora_path"))
        name = fields["lora_name"]
        if name in models or _model_of_adapter(models, name) is not None:
            raise HTTPError(400, f"the name '{name}' is taken: a model or adapter of this server has it")
        try:
            await asyncio.to_thread(model.session.load_adapter, name, fields["lora_path"])
        except AviatorError as error:
            raise HTTPError(400, str(error)) from None
        log.warning("loaded LoRA adapter '%s' from %s beside '%s'", name, fields["lora_path"], model.name)
        return JSONResponse({"status": "ok", "lora_name": name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> JSONResponse:
        model, fields = _lora_request(models, await raw.body(), ("lora_name",))
        try:
            model.session.unload_adapter(fields["lora_name"])
        except AviatorError as error:
            raise HTTPError(404 if "no adapter named" in str(error) else 409, str(error)) from None
        return JSONResponse({"status": "ok", "lora_name": fields["lora_name"]})

    bounds = Bounds(prompts=max(m.engine.max_queue + m.engine.slots for m in models.values()),
                    tokens=max(m.session.context for m in models.values()))

    async def accept(raw: Request, kind: type[Body]) -> Body:
        if app.state.draining:
            raise HTTPError(503, "the server is shutting down", "service_unavailable_error")
        return await asyncio.to_thread(parse_request, await raw.body(), kind, bounds)

    @app.post("/v1/completions", response_model=None, openapi_extra=_schema(CompletionRequest))
    async def completions(raw: Request) -> Any:
        body = await accept(raw, CompletionRequest)
        model, adapter = _model(models, body.model)
        prompts = _completion_prompts(model, body.prompt)
        return await _serve(model, body, prompts, raw, chat=False, adapter=adapter)

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=_schema(ChatRequest))
    async def chat(raw: Request) -> Any:
        body = await accept(raw, ChatRequest)
        model, adapter = _model(models, body.model)
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise HTTPError(400, f"model '{model.name}' has no tokenizer with a chat template: chat needs one "
                                 "(start the server with --tokenizer), or use /v1/completions with token ids")
        messages = [{"role": m.role, "content": m.text(), **{k: v for k, v in (m.model_extra or {}).items()
                                                             if k in ("tool_calls", "tool_call_id", "name")}}
                    for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tool_mode != "none" and body.tools else None
        try:
            text = model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # noqa: BLE001 - templates raise on conversations they refuse (roles out of turn)
            raise HTTPError(400, f"the chat template refused these messages: {error}") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _serve(model, body, [model.tokenizer.encode(text, add_special_tokens=False)], raw, chat=True,
                            adapter=adapter)

    return app


def _schema(kind: type[Body]) -> dict[str, Any]:
    # The body is parsed by hand (off the event loop): tell the OpenAPI page its shape.
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": kind.model_json_schema()}}}}


def _model(models: dict[str, ServedModel], name: str | None) -> tuple[ServedModel, str | None]:
    """The model a request names, and the LoRA adapter it runs with when the name is an adapter's."""
    if name is None:
        if len(models) == 1:
            return next(iter(models.values())), None
        raise HTTPError(400, f"say which model: this server holds {', '.join(models)}")
    if name in models:
        return models[name], None
    parent = _model_of_adapter(models, name)
    if parent is None:
        raise HTTPError(404, f"the model '{name}' does not exist; this server holds {', '.join(models)}",
                        "not_found_error")
    return parent, name


def _model_of_adapter(models: dict[str, ServedModel], name: str) -> ServedModel | None:
    return next((m for m in models.values() if m.session.adapters is not None and name in m.session.adapters.loaded),
                None)


def _lora_request(models: dict[str, ServedModel], raw: bytes, keys: tuple[str, ...]) -> tuple[ServedModel, dict[str, str]]:
    """The model whose adapters a load or unload request changes (the first that runs them), and
    the request's string fields."""
    model = next((m for m in models.values() if m.session.adapters is not None), None)
    if model is None:
        raise HTTPError(404, "this server loads no LoRA adapters: start it with --enable-lora", "not_found_error")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "the body is not JSON") from None
    if not isinstance(data, dict) or any(not isinstance(data.get(k), str) or not data.get(k) for k in keys):
        raise HTTPError(400, f"the body must be an object with {' and '.join(repr(k) for k in keys)} (strings)")
    return model, {k: data[k] for k in keys}


def _vocabulary(model: ServedModel) -> int | None:
    """The width of the model's logits."""
    logits = model.session.cache.logits if model.session.cache else None
    vocab = next((v.type.shape[-1] for v in model.session.graph.outputs if v.name == logits), None)
    return vocab if isinstance(vocab, int) else None


def _constraints(model: ServedModel, body: SamplingFields, count: int) -> list[Any]:
    """One grammar constraint per prompt for a structured output (None each for free text). Runs
    in a worker thread: the first one reads the tokenizer into llguidance (about a second)."""
    from aviatorc.serve.structured import Grammars

    asked = body.structure()
    if asked is None:
        return [None] * count
    vocab = _vocabulary(model)
    if model.tokenizer is None or vocab is None:
        raise HTTPError(400, f"model '{model.name}' has no tokenizer: structured outputs need one (start the server "
                             "with --tokenizer)")
    if model.grammars is None:
        model.grammars = Grammars(model.tokenizer, vocab)
    return [model.grammars.constraint(*asked) for _ in range(count)]


def _completion_prompts(model: ServedModel, prompt: Any) -> list[list[int]]:
    """One list of ids per prompt: text through the tokenizer, ids as given."""
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    out = []
    for item in batch:
        if isinstance(item, str):
            if model.tokenizer is None:
                raise HTTPError(400, f"model '{model.name}' has no tokenizer: send the prompt as token ids, or start "
                                     "the server with --tokenizer")
            out.append(list(model.tokenizer.encode(item)))
        else:
            out.append(list(item))
    vocab = _vocabulary(model)
    for ids in out:
        if not ids:
            raise HTTPError(400, "a prompt is empty")
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise HTTPError(400, f"a prompt holds token ids outside the vocabulary (0..{vocab - 1})")
    return out


def _generation_requests(model: ServedModel, body: SamplingFields, prompts: list[list[int]],
                         constraints: list[Any], adapter: str | None = None) -> list[GenerationRequest]:
    stop_ids = set(body.stop_token_ids)
    eos = getattr(model.tokenizer, "eos_token_id", None)
    if eos is not None and not body.ignore_eos:
        stop_ids.add(int(eos))
    room = model.session.context
    out = []
    for ids, constraint in zip(prompts, constraints, strict=True):
        max_tokens = body.max_tokens if body.max_tokens is not None else max(1, room - len(ids))
        out.append(GenerationRequest(prompt=ids, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     seed=body.seed, stop_ids=frozenset(stop_ids), priority=body.priority,
                                     timeout_s=body.timeout, logprobs=body.top_logprobs, constraint=constraint,
                                     adapter=adapter))
    return out


async def _serve(model: ServedModel, body: SamplingFields, prompts: list[list[int]], raw: Request,
                 *, chat: bool, adapter: str | None = None) -> Any:
    body.check_supported()
    constraints = await asyncio.to_thread(_constraints, model, body, len(prompts))
    requests = _generation_requests(model, body, prompts, constraints, adapter)
    submitted: list[GenerationRequest] = []
    try:
        for request in requests:
            submitted.append(model.engine.submit(request))
    except Exception as error:
        for request in submitted:  # all of the request's prompts or none
            request.cancel()
        model.engine.wake()
        if isinstance(error, QueueFull):
            model.metrics.rejected()
            raise HTTPError(429, str(error), "rate_limit_error") from None
        raise
    shape = _Shape(model, body, chat, adapter or model.name)
    if body.stream:
        return EventSourceResponse(_stream(model, shape, submitted), ping=15)
    return await _complete(model, shape, submitted, raw)


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_MISTRAL_CALLS = "[TOOL_CALLS]"


def _tool_call_json(text: str) -> Any:
    """The JSON of the tool calls in a chat answer, in the forms models write them: the JSON alone
    (Llama 3's), `<tool_call>{...}</tool_call>` blocks and nothing else (Hermes', Qwen's), or
    `[TOOL_CALLS]` and a JSON list (Mistral's). ValueError for any other answer."""
    stripped = text.strip()
    if stripped.startswith(_MISTRAL_CALLS):
        return json.loads(stripped.removeprefix(_MISTRAL_CALLS))
    blocks = _HERMES_CALL.findall(stripped)
    if blocks and not _HERMES_CALL.sub("", stripped).strip():
        return [json.loads(block) for block in blocks]
    return json.loads(stripped)


class _Shape:
    """Builds the response objects of one request (completion or chat)."""

    def __init__(self, model: ServedModel, body: SamplingFields, chat: bool, name: str) -> None:
        self.model, self.body, self.chat, self.name = model, body, chat, name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.with_ids = body.return_token_ids or model.tokenizer is None
        self.asked_logprobs = body.top_logprobs is not None
        self._texts: dict[int, str] = {}
        self.tool_mode = body.tool_mode if isinstance(body, ChatRequest) else "none"
        self.tool_names = {t.function.name for t in body.tools or ()} if isinstance(body, ChatRequest) else set()

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name, "choices": choices}

    def choice(self, index: int, text: str, finish: str | None, ids: list[int] | None, *, chunk: bool,
               prompt: list[int] | None = None, reported: Sequence[Logprobs] = (), offset: int = 0) -> dict[str, Any]:
        """One choice; `reported`: the log-probabilities of its `ids`, `offset`: the characters of
        the choice's text before them."""
        logprobs = self.logprobs(reported, offset) if self.asked_logprobs and (reported or not chunk) else None
        if self.chat:
            body: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
            content: dict[str, Any] = {"content": text} if text or not chunk else {}
            calls = self.tool_calls(text) if finish is not None else None
            if calls:
                content = {"content": None, "tool_calls": calls if not chunk else [
                    {"index": i, **call} for i, call in enumerate(calls)]}
                body["finish_reason"] = "tool_calls" if finish == "stop" else finish
            if chunk:
                body["delta"] = content
            else:
                body["message"] = {"role": "assistant", **content}
        else:
            body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.with_ids and ids is not None:
            body["token_ids"] = ids
            if prompt is not None:
                body["prompt_token_ids"] = prompt
        return body

    @property
    def buffered(self) -> bool:
        """A stream that may turn out to be a tool call sends its text once, at its end."""
        return self.tool_mode != "none"

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls a finished chat answer holds, in OpenAI's shape; None for plain text.
        named: the text is the function's arguments; required: a JSON list of {name, parameters}
        (what the grammar enforced); auto: the text, if it holds one such call or a list of them in
        a form models write (`_tool_call_json`), else it is the answer's content."""
        if self.tool_mode == "none":
            return None
        if self.tool_mode == "named":
            assert isinstance(self.body, ChatRequest) and self.body.tool_choice is not None
            name = self.body.tool_choice.function.name  # type: ignore[union-attr]
            return [self._call(name, text)] if _is_json(text) else None
        try:
            found = _tool_call_json(text)
        except ValueError:
            return None
        found = found if isinstance(found, list) else [found]
        calls = []
        for item in found:
            if not isinstance(item, dict) or item.get("name") not in self.tool_names:
                return None
            arguments = item.get("parameters", item.get("arguments", {}))
            calls.append(self._call(item["name"], arguments if isinstance(arguments, str)
                                    else json.dumps(arguments, separators=(",", ":"))))
        return calls or None

    @staticmethod
    def _call(name: str, arguments: str) -> dict[str, Any]:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": arguments}}

    def token_text(self, token: int) -> str:
        if token not in self._texts:
            tokenizer = self.model.tokenizer
            self._texts[token] = f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])
        return self._texts[token]

    def logprobs(self, reported: Sequence[Logprobs], offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object of a choice's tokens."""
        texts = [self.token_text(r.token) for r in reported]
        if self.chat:
            def entry(token: int, text: str, logprob: float) -> dict[str, Any]:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [entry(r.token, text, r.logprob) | {
                "top_logprobs": [entry(t, self.token_text(t), lp) for t, lp in r.top]} for r, text in zip(reported, texts)],
                "refusal": None}
        return {"tokens": texts, "token_logprobs": [r.logprob for r in reported],
                "top_logprobs": [{self.token_text(t): lp for t, lp in r.top} for r in reported],
                "text_offset": list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []}

    @staticmethod
    def usage(requests: list[GenerationRequest], texts: list[TextStream]) -> dict[str, int]:
        prompt = sum(len(r.prompt) for r in requests)
        completion = sum(len(t.kept(r.generated)) for r, t in zip(requests, texts))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _finish_reason(end: Finished, text: TextStream) -> str:
    return "stop" if text.stopped else end.reason


async def _complete(model: ServedModel, shape: _Shape, requests: list[GenerationRequest], raw: Request) -> Any:
    """Wait for every choice (a client that goes away cancels them), then one response."""
    texts = [TextStream(model.tokenizer, shape.body.stops) for _ in requests]
    waiting = asyncio.ensure_future(asyncio.gather(*(_drain(model, r, t) for r, t in zip(requests, texts))))
    while not waiting.done():
        done, _ = await asyncio.wait({waiting}, timeout=0.25)
        if not done and await raw.is_disconnected():
            for request in requests:
                request.cancel()
            model.engine.wake()
    ends: list[Finished] = waiting.result()
    for end in ends:
        if end.reason in _STATUS:
            status, body = _ended(end)
            return JSONResponse(body, status_code=status)
    choices = []
    for i, (r, t, e) in enumerate(zip(requests, texts, ends)):
        kept = t.kept(r.generated)
        choices.append(shape.choice(i, t.text, _finish_reason(e, t), kept, chunk=False, prompt=r.prompt,
                                    reported=r.reported[:len(kept)]))
    return {**shape.envelope(choices, chunk=False), "usage": shape.usage(requests, texts)}


async def _drain(model: ServedModel, request: GenerationRequest, text: TextStream) -> Finished:
    """Follow one request to its end, stopping it at a stop string."""
    async for event in request.events():
        if isinstance(event, Finished):
            text.push(request.generated, final=True)
            return event
        text.push(request.generated)
        if text.stopped:
            request.stop()
            model.engine.wake()
    raise AssertionError("unreachable")


async def _stream(model: ServedModel, shape: _Shape, requests: list[GenerationRequest]) -> AsyncIterator[str]:
    """SSE data of every choice as its tokens come; a client that goes away cancels them (sse-starlette
    cancels this generator)."""
    queue: asyncio.Queue[tuple[int, Token | Finished]] = asyncio.Queue()

    async def follow(index: int, request: GenerationRequest) -> None:
        async for event in request.events():
            await queue.put((index, event))

    followers = [asyncio.create_task(follow(i, r)) for i, r in enumerate(requests)]
    texts = [TextStream(model.tokenizer, shape.body.stops) for _ in requests]
    sent = [0] * len(requests)
    offsets = [0] * len(requests)  # characters of each choice's tokens sent (completions' text_offset)
    try:
        if shape.chat:
            yield json.dumps(shape.envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None} for i in range(len(requests))], chunk=True))
        open_choices = len(requests)
        while open_choices:
            index, event = await queue.get()
            request, text = requests[index], texts[index]
            if isinstance(event, Token):
                if text.stopped:
                    continue
                delta = text.push(request.generated)
                if text.stopped:
                    request.stop()
                    model.engine.wake()
                if shape.buffered:
                    continue
                ids = text.kept(request.generated)[sent[index]:]
                reported = request.reported[sent[index]:sent[index] + len(ids)]
                sent[index] += len(ids)
                yield json.dumps(shape.envelope([shape.choice(index, delta, None, ids, chunk=True, reported=reported,
                                                              offset=offsets[index])], chunk=True))
                offsets[index] += sum(len(shape.token_text(r.token)) for r in reported)
                continue
            open_choices -= 1
            if event.reason in _STATUS:
                yield json.dumps(_ended(event)[1])
                continue
            delta = text.push(request.generated, final=True)
            if shape.buffered:
                kept = text.kept(request.generated)
                delta, ids, reported = text.text, kept, request.reported[:len(kept)]
            else:
                ids, reported = [], []
            yield json.dumps(shape.envelope([shape.choice(index, delta, _finish_reason(event, text), ids, chunk=True,
                                                          reported=reported)], chunk=True))
        if shape.body.include_usage:
            yield json.dumps({**shape.envelope([], chunk=True), "usage": shape.usage(requests, texts)})
        yield "[DONE]"
    finally:
        for request in requests:
            if request.finished is None:
                request.cancel()
        model.engine.wake()
        for task in followers:
            task.cancel()
