"""The OpenAI request bodies the server accepts, and the text side of a stream.

Fields follow OpenAI's API, with vLLM's extensions where they exist: `priority` (lower runs
first), `return_token_ids`, `stop_token_ids`, `ignore_eos`; and one of ours, `timeout` (seconds,
capped by the server's `--request-timeout`). A field OpenAI defines that this server does not
implement (`n` > 1, `logprobs`, penalties, tools, ...) is refused with 400 rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from aviatorc.errors import OptionError

MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)  # OpenAI's default
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(default=None, max_length=4)  # OpenAI's limit: up to 4
    stop_token_ids: list[int] = Field(default=[], max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0.0)
    n: int = 1

    def check_supported(self) -> None:
        if self.n != 1:
            raise OptionError(f"n={self.n} is not supported: one choice per prompt", hint="send n=1")
        for name in ("logprobs", "top_logprobs", "best_of", "suffix", "tools", "functions", "logit_bias",
                     "response_format"):
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


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


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


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


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
