"""The ``POST /v1/completions`` body the reference server accepts, and its errors.

:class:`CompletionRequest` validates a decoded JSON body; :class:`RequestError` is a
rejection with its HTTP status and an OpenAI-style error body. Used by
:mod:`.engine` (a prompt too long for the pool) and :mod:`.openai_server`.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..tokenizer import VOCAB_SIZE, encode

__all__ = ["DEFAULT_MAX_TOKENS", "CompletionRequest", "RequestError", "describe"]

#: OpenAI's default ``max_tokens`` for completions
DEFAULT_MAX_TOKENS = 16

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def _show(value: object) -> str:
    """A bad value for an error message, bounded in length and nesting (a body may be
    megabytes long or nested hundreds deep)."""
    return _SHOW.repr(value)


#: a decoded JSON value's Python type -> its name in an error message, one and many
_JSON_KINDS: dict[type, tuple[str, str]] = {
    bool: ("a boolean", "booleans"), int: ("an integer", "integers"), float: ("a float", "floats"),
    str: ("a string", "strings"), list: ("a list", "lists"), dict: ("an object", "objects"),
    type(None): ("null", "nulls"),
}
#: most items, characters and levels :func:`_json_short` shows
_SHORT_ITEMS, _SHORT_CHARS, _SHORT_DEPTH = 4, 40, 4


def describe(value: object) -> str:
    """What a decoded JSON value is, by its JSON name, and a short rendering of it::

        [true]      -> a list of booleans: [true]
        [1, 1.5]    -> a list of integers and floats: [1, 1.5]
        {"a": 1}    -> an object: {"a": 1}
        1.5         -> a float: 1.5

    Bounded in length and nesting, whatever the value (a body may be megabytes long or
    nested hundreds deep)."""
    if isinstance(value, list):
        if not value:
            return "an empty list"
        kinds = list(dict.fromkeys(_JSON_KINDS.get(type(x), ("", type(x).__name__))[1] for x in value))
        what = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
        return f"a list of {what}: {_json_short(value)}"
    if value is None:
        return "null"
    name = _JSON_KINDS.get(type(value), (type(value).__name__, ""))[0]
    return f"{name}: {_json_short(value)}"


def _json_short(value: object, depth: int = 0) -> str:
    """``value`` as JSON, with long strings, lists, objects and deep nesting cut ("...")."""
    if depth >= _SHORT_DEPTH and isinstance(value, (list, dict)) and value:
        return "[...]" if isinstance(value, list) else "{...}"
    if isinstance(value, list):
        items = [_json_short(x, depth + 1) for x in value[:_SHORT_ITEMS]]
        return "[" + ", ".join(items + (["..."] if len(value) > _SHORT_ITEMS else [])) + "]"
    if isinstance(value, dict):
        items = [f"{_json_short(str(k))}: {_json_short(v, depth + 1)}" for k, v in list(value.items())[:_SHORT_ITEMS]]
        return "{" + ", ".join(items + (["..."] if len(value) > _SHORT_ITEMS else [])) + "}"
    if isinstance(value, str) and len(value) > _SHORT_CHARS:
        return json.dumps(value[:_SHORT_CHARS])[:-1] + '..."'
    return json.dumps(value)


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
            raise RequestError(HTTPStatus.BAD_REQUEST, f"body: expected a JSON object, got {describe(body)}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"model: expected a string (the served model's name, "
                                                       f"`{served_model}`), got {describe(model)}", param="model")
        if model is not None and model != served_model:
            shown = model[:100]
            raise RequestError(HTTPStatus.NOT_FOUND, f"The model `{shown}` does not exist; this server "
                                                     f"serves `{served_model}`", param="model",
                               kind="NotFoundError")
        if "prompt" not in body:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected one prompt, a string or a list of token "
                                                       "ids, got none (the body has no \"prompt\")", param="prompt")
        prompt = body["prompt"]
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
                                                       f"token ids, got {_prompt_kind(prompt)}", param="prompt")
        if not tokens:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected at least one token, got an empty prompt",
                               param="prompt")
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens: expected an integer >= 1, got "
                                                       f"{describe(max_tokens)}", param="max_tokens")
        for name, allowed, shown in (("n", 1, "1"), ("best_of", 1, "1"), ("echo", False, "false")):
            value = body.get(name)
            if value is not None and (type(value) is not type(allowed) or value != allowed):
                raise RequestError(HTTPStatus.BAD_REQUEST, f"{name}: this server supports only {shown}, "
                                                           f"got {describe(value)}", param=name)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream: expected true or false, got {describe(stream)}",
                               param="stream")
        options = body.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream_options: expected an object, got "
                                                       f"{describe(options)}", param="stream_options")
        include_usage = options.get("include_usage", False)
        if include_usage is None:
            include_usage = False
        if not isinstance(include_usage, bool):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream_options.include_usage: expected true or false, got "
                                                       f"{describe(include_usage)}", param="stream_options")
        return cls(prompt_tokens=tokens, max_tokens=max_tokens, stream=stream, include_usage=include_usage)


def _prompt_kind(prompt: object) -> str:
    """What a prompt that is neither a string nor a list of token ids is; a list of
    several strings or token lists is a batch, which this server does not take."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return f"{describe(prompt)} (a batch of {len(prompt)} prompts: send one prompt per request)"
    return describe(prompt)
