"""The OpenAI request bodies the server accepts, and the text side of a stream.

Fields follow OpenAI's API, with vLLM's extensions where they exist: `priority` (lower runs
first), `return_token_ids`, `stop_token_ids`, `ignore_eos`; and one of ours, `timeout` (seconds,
capped by the server's `--request-timeout`). A field OpenAI defines that this server does not
implement (`n` > 1, penalties, tools, ...) is refused with 400 rather than ignored.
Log-probabilities: completions' `logprobs` (how many of the most likely tokens to list beside
each chosen one), chat's `logprobs` and `top_logprobs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from aviatorc.errors import OptionError
from aviatorc.runtime.sampling import MAX_TOP_LOGPROBS

MAX_STOP_CHARS = 256


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error body, for every status the server answers with."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


# JSON `true` is not token id 1: pydantic's lax mode would take booleans (and "5") as integers.
TokenId = Annotated[int, Strict()]
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class Bounds:
    """What one request may hold, checked on the decoded JSON before the (slower) validation: a
    body under the byte limit can still hold a million token ids."""

    prompts: int  # prompts in one completion request (more than the queue holds are refused anyway)
    tokens: int  # ids in one prompt, messages in one chat: the largest context served


def parse_request(data: bytes, model: type[Body], bounds: Bounds) -> Body:
    """A request body as `model`, or an `OptionError` saying what is wrong with it. The server runs
    this in a worker thread: a large body must not stall the event loop (and `/health`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise OptionError(f"the request body is not UTF-8 (byte {error.start} is {data[error.start]:#04x})",
                          hint="send JSON encoded as UTF-8") from None
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise OptionError("the request body is not valid JSON: it nests too deeply") from None
    except ValueError as error:
        raise OptionError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise OptionError(f"the request body must be a JSON object, not {type(raw).__name__}")
    _check_bounds(raw, bounds)
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise OptionError(describe(error)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_bounds(raw: dict[str, Any], bounds: Bounds) -> None:
    prompt = raw.get("prompt")
    if isinstance(prompt, list):
        prompts = prompt if prompt and isinstance(prompt[0], (list, str)) else [prompt]
        if len(prompts) > bounds.prompts:
            raise OptionError(f"the request holds {len(prompts)} prompts; this server queues at most {bounds.prompts}")
        longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
        if longest >= bounds.tokens:
            raise OptionError(f"a prompt has {longest} tokens but the model's context is {bounds.tokens}: no room "
                              "to generate", hint="shorten the prompt")
    messages = raw.get("messages")
    if isinstance(messages, list) and len(messages) > bounds.tokens:
        raise OptionError(f"the chat has {len(messages)} messages but the model's context is {bounds.tokens} tokens")


def describe(error: ValidationError) -> str:
    """pydantic's errors as one line: 'field.path: what is wrong; ...'."""
    problems = []
    for e in error.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"] if not _is_union_branch(p))
        problems.append(f"{where}: {e['msg']}" if where else e["msg"])
    return "; ".join(dict.fromkeys(problems)) or "invalid request"


def _is_union_branch(part: Any) -> bool:
    # pydantic names the member of a union it tried ('list[int]', 'str'): not a field of the body
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)  # OpenAI's default
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(default=None, max_length=4)  # OpenAI's limit: up to 4
    stop_token_ids: list[TokenId] = Field(default=[], max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0.0)
    n: int = 1
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise OptionError(f"n={self.n} is not supported: one choice per prompt", hint="send n=1")
        for name in ("best_of", "suffix", "functions", "function_call", "logit_bias", "tools", "tool_choice"):  # chat declares tools
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, 0, {}, []):
                raise OptionError(f"'{name}' is not supported by this server")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, 0, 0.0) and not (name == "repetition_penalty" and value == 1.0):
                raise OptionError(f"'{name}' is not supported by this server")
        if (self.model_extra or {}).get("echo"):
            raise OptionError("'echo' is not supported by this server")

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise OptionError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k most likely alternatives'."""
        return None

    def structure(self) -> tuple[str, Any] | None:
        """The structured output asked for, as (format, its schema / regex / choices / grammar),
        one of `aviatorc.serve.structured.FORMATS`; None for free text."""
        asked: list[tuple[str, Any]] = []
        r = self.response_format
        if r is not None and r.type == "json_object":
            asked.append(("json_object", None))
        elif r is not None and r.type == "json_schema":
            if r.json_schema is None:
                raise OptionError("response_format of type json_schema needs its 'json_schema'")
            asked.append(("json_schema", r.json_schema.schema_))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar)) if v is not None]
            if len(given) != 1:
                raise OptionError(f"structured_outputs needs exactly one of json, regex, choice, grammar; got {len(given)}")
            asked += given
        if len(asked) > 1:
            raise OptionError("give response_format or structured_outputs, not both")
        return asked[0] if asked else None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_the_prompt_shapes(cls, value: Any) -> Any:
        # One message for a prompt of no known shape, instead of one per member of the union.
        def ids(item: Any) -> bool:
            return isinstance(item, list) and all(type(t) is int for t in item)

        if isinstance(value, str) or ids(value) or isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(ids(p) for p in value)):
            return value
        raise ValueError("a prompt is a string, a list of token ids (integers: not true/false, not strings), "
                         "a list of strings, or a list of lists of token ids")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are understood
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise OptionError(f"message content of type '{part.get('type')}' is not supported")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class Function(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class ToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs_: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, alias="top_logprobs")
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def top_logprobs(self) -> int | None:
        if self.top_logprobs_ is not None and not self.logprobs:
            raise OptionError("top_logprobs needs logprobs: true", hint="send \"logprobs\": true with it")
        return (self.top_logprobs_ or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str:
        """"none", "auto" (the model may call one), "required" (it must call at least one), or
        "named" (it must call `tool_choice`'s function), as OpenAI defines `tool_choice`."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise OptionError("tool_choice needs tools")
            return "none"
        if isinstance(self.tool_choice, ToolChoice):
            if self.tool_choice.function.name not in {t.function.name for t in self.tools}:
                raise OptionError(f"tool_choice names '{self.tool_choice.function.name}', which is not among the tools")
            return "named"
        return self.tool_choice or "auto"

    def structure(self) -> tuple[str, Any] | None:
        """A named or required tool call is a structured output: the function's parameters, or a
        list of calls each of one tool's name and parameters (as vLLM enforces them)."""
        asked = super().structure()
        mode = self.tool_mode
        if mode not in ("named", "required"):
            return asked
        if asked is not None:
            raise OptionError("a required tool call and response_format / structured_outputs exclude each other")
        assert self.tools is not None
        if mode == "named":
            assert isinstance(self.tool_choice, ToolChoice)
            chosen = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return "json_schema", chosen.function.parameters
        calls = [{"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": t.function.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return "json_schema", schema


class TextStream:
    """Detokenizes a growing list of ids into text deltas, and finds stop strings.

    The whole sequence is decoded each time (so multi-byte characters split across tokens come
    out whole: a trailing U+FFFD is held back), and text that could still become the start of
    a stop string is held back until it cannot."""

    def __init__(self, tokenizer: Any | None, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters already handed out
        self.stopped = False
        self.text = ""
        self.tokens: int | None = None  # at a stop string: the tokens that made the text up to it

    def kept(self, ids: list[int]) -> list[int]:
        """The ids a response reports: none past the token that completed a stop string (the
        engine may have made more before it heard of the stop)."""
        return ids if self.tokens is None else ids[:self.tokens]

    def push(self, ids: list[int], *, final: bool = False) -> str:
        """The new text after `ids` (the request's tokens so far); sets `stopped` at a stop string."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                text, self.stopped, final = text[:at], True, True
                self.tokens = len(ids)
        self.text = text
        ready = len(text)
        if not final:
            if text.endswith("\ufffd"):
                ready -= 1
            held = max((len(s) - 1 for s in self.stops), default=0)
            for n in range(min(held, ready), 0, -1):
                if any(s.startswith(text[ready - n:ready]) for s in self.stops):
                    ready -= n
                    break
        ready = max(ready, self.sent)
        delta, self.sent = text[self.sent:ready], ready
        return delta
