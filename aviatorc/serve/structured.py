"""Structured outputs: the tokens a grammar allows next, as a mask on the logits (llguidance).

    grammars = Grammars(tokenizer, vocab=128)            # once per served model (about a second)
    constraint = grammars.constraint("json_schema", schema_text)
    token = sample(constraint.mask(logits))             # only tokens the grammar allows
    constraint.accept(token); constraint.done           # complete: the request ends ("stop")

Formats: OpenAI's `response_format` (`json_object`: any JSON object; `json_schema`: its
`schema`) and vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`: Lark or GBNF).
JSON is written without optional whitespace, so an output cannot pad itself forever.

llguidance rather than xgrammar: it has no dependencies (xgrammar brings triton, about 1 GB),
computes a mask in tens of microseconds from the tokenizer's own vocabulary, reads all of the
formats above, and is the grammar engine of vLLM, SGLang and llama.cpp as well.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from aviatorc.errors import OptionError
from aviatorc.extras import require

FORMATS = ("json_object", "json_schema", "json", "regex", "choice", "grammar")
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


class Grammars:
    """A served model's tokenizer as llguidance reads it; makes each request's constraint."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        require("serve", "structured outputs")
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        except ValueError as error:  # a slow (Python) tokenizer, or one whose decoder llguidance cannot read
            raise OptionError(f"structured outputs cannot use this model's tokenizer: {error}") from None
        self.vocab = vocab

    def constraint(self, kind: str, spec: Any) -> Constraint:
        """The constraint of one request: `kind` one of FORMATS, `spec` its schema, regex, choices
        or grammar text (a 400 for the client when it is not valid)."""
        import llguidance

        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif kind in ("json_schema", "json"):
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise OptionError(f"a JSON schema must be an object, not {type(schema).__name__}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        elif kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
                raise OptionError("'choice' must be a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", json.dumps(spec))
        elif kind in ("regex", "grammar"):
            if not isinstance(spec, str):
                raise OptionError(f"'{kind}' must be a string")
            try:
                grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)
            except ValueError as error:
                raise OptionError(f"the {kind} is not valid: {error}") from None
        else:
            raise OptionError(f"unknown structured output '{kind}'", hint=f"use one of {', '.join(FORMATS)}")
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise OptionError(f"the {kind.replace('_', ' ')} cannot be enforced: {problem}")
        return Constraint(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab)


class Constraint:
    """One request's place in its grammar: which tokens may come next, and whether it is done."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab
        self._allowed: np.ndarray | None = None  # the mask of the current state, once computed

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary of the tokens the grammar allows next (kept until
        the next token is accepted: the engine computes it while a decode step runs)."""
        if self._allowed is None:
            bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
            self._allowed = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        return self._allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar does not allow at -inf."""
        allowed = self.allowed()
        if not allowed.any():
            raise OptionError("the requested structure cannot continue with this model's vocabulary"
                              + (f": {self.matcher.get_error()}" if self.matcher.is_error() else ""))
        return np.where(allowed, np.asarray(logits, dtype=np.float64), -np.inf)

    def accept(self, token: int) -> None:
        self._allowed = None
        if not self.matcher.consume_token(int(token)):
            raise OptionError(f"token {token} breaks the requested structure: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more (the request stops)."""
        return bool(self.matcher.is_stopped())

    def greedy(self, rows: np.ndarray, proposal: Sequence[int]) -> list[int]:
        """Speculative verification under the grammar: the greedy choice at each position of
        `rows` (the target's logits after the last token and after each drafted one), with the
        grammar advanced along the drafts as long as they are the choices; the state is left
        as it was. Ends at the first disagreement (the target's token there is the last)."""
        choices: list[int] = []
        consumed = 0
        for i, row in enumerate(rows):
            choice = int(np.argmax(self.mask(row)))
            choices.append(choice)
            if i == len(proposal) or proposal[i] != choice:
                break
            self._allowed = None
            if not self.matcher.consume_token(choice):
                break
            consumed += 1
            if self.done:
                break
        self.matcher.rollback(consumed)
        self._allowed = None
        return choices
