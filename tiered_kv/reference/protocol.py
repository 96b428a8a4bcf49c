"""The ``POST /v1/completions`` body the reference server accepts, and its errors.

:class:`CompletionRequest` validates a decoded JSON body; :class:`RequestError` is a
rejection with its HTTP status and an OpenAI-style error body. Used by
:mod:`.engine` (a prompt too long for the pool) and :mod:`.openai_server`.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..tokenizer import VOCAB_SIZE, encode

__all__ = ["DEFAULT_MAX_TOKENS", "CompletionRequest", "RequestError"]

#: OpenAI's default ``max_tokens`` for completions
DEFAULT_MAX_TOKENS = 16

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def _show(value: object) -> str:
    """A bad value for an error message, bounded in length and nesting (a body may be
    megabytes long or nested hundreds deep)."""
    return _SHOW.repr(value)


class RequestError(Exception):
    """A request the server rejects: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: HTTPStatus, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": int(self.status)}}


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: object, *, served_model: str) -> CompletionRequest:
        """Validate a decoded JSON body; :class:`RequestError` (400, or 404 for another
        model) names the field and what was expected."""
        if not isinstance(body, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"expected a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != served_model:
            shown = model[:100] if isinstance(model, str) else _show(model)
            raise RequestError(HTTPStatus.NOT_FOUND, f"The model `{shown}` does not exist; this server "
                                                     f"serves `{served_model}`", param="model",
                               kind="NotFoundError")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            try:
                tokens = encode(prompt)
            except UnicodeEncodeError as exc:  # JSON's "\\ud800" escapes spell lone surrogates
                raise RequestError(HTTPStatus.BAD_REQUEST, f"prompt: expected valid Unicode text, got a lone "
                                                           f"surrogate U+{ord(prompt[exc.start]):04X} at character "
                                                           f"{exc.start}", param="prompt") from None
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < VOCAB_SIZE), None)
            if bad is not None:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"prompt: expected token ids in [0, {VOCAB_SIZE}) "
                                                           f"(byte-level vocabulary), got {_show(bad)}", param="prompt")
            tokens = list(prompt)
        else:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected one prompt, a string or a list of "
                                                       f"token ids, got {_kind(prompt)}", param="prompt")
        if not tokens:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected at least one token, got an empty prompt",
                               param="prompt")
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens: expected an integer >= 1, got {_show(max_tokens)}",
                               param="max_tokens")
        for name, allowed in (("n", 1), ("best_of", 1), ("echo", False)):
            if name in body and body[name] not in (None, allowed):
                raise RequestError(HTTPStatus.BAD_REQUEST, f"{name}: this server supports only {allowed!r}, "
                                                           f"got {_show(body[name])}", param=name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream: expected true or false, got {_show(stream)}",
                               param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream_options: expected an object, got {_kind(options)}",
                               param="stream_options")
        return cls(prompt_tokens=tokens, max_tokens=max_tokens, stream=stream,
                   include_usage=bool(options.get("include_usage", False)))


def _kind(x: object) -> str:
    return "a list of strings or lists (a batch: send one prompt per request)" if isinstance(x, list) \
        else type(x).__name__
