"""Prompt files (``--prompts``): JSONL of ``{"id", "tokens"}`` or ``{"id", "text"}``, the
bundled demo set, or stdin; bad input is a UsageError naming the line."""

from __future__ import annotations

import json
import reprlib
import sys
from dataclasses import dataclass
from pathlib import Path

from .main import UsageError

__all__ = ["BUNDLED_PROMPTS", "Prompt", "load_prompts", "prompts_arg_help", "show"]

#: ``--prompts`` value that selects the prompt set shipped with the package.
BUNDLED_PROMPTS = "bundled"
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompt file."""

    id: str
    tokens: list[int]
    #: the line's ``text`` (``tokens`` are its bytes); None for a line of ``tokens``. What
    #: ``warm-start --endpoint`` sends, so the server tokenizes it with its own tokenizer.
    text: str | None = None


def prompts_arg_help(what: str) -> str:
    return (f"{what}: a JSONL file, one {{\"id\": ..., \"tokens\": [...]}} or {{\"id\": ..., "
            f"\"text\": \"...\"}} per line (text is tokenized byte-level: UTF-8 bytes as ids); "
            f"'{BUNDLED_PROMPTS}' for the demo set shipped with tiered_kv, '-' for stdin")


def load_prompts(spec: str, *, vocab_size: int | None = None) -> list[Prompt]:
    """Read the prompts of ``--prompts spec``; UsageError naming the line on bad input.

    ``vocab_size``: token ids must be below it (the model's vocabulary), else any uint32.
    """
    from ..tokenizer import encode

    name, text = _read_prompt_source(spec)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts {name} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise UsageError(f"{where}: expected a JSON object, got JSON nested too deeply to read") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        pid = obj.get("id", f"#{n}")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise UsageError(f"{where}: id: expected a string or integer, got {show(pid)}")
        pid = str(pid)
        _check_unicode(f"{where}: id", pid)
        if pid in seen:
            raise UsageError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        has_tokens, has_text = "tokens" in obj, "text" in obj
        if has_tokens == has_text:
            raise UsageError(f"{where}: expected exactly one of \"tokens\" or \"text\", got "
                             f"{'both' if has_tokens else 'neither'}")
        if has_text:
            if not isinstance(obj["text"], str):
                raise UsageError(f"{where}: text: expected a string, got {type(obj['text']).__name__}")
            _check_unicode(f"{where}: text", obj["text"])
            tokens = encode(obj["text"])
        else:
            tokens = _check_tokens(where, obj["tokens"], vocab_size)
        if not tokens:
            raise UsageError(f"{where}: prompt {pid!r} is empty; expected at least one token")
        prompts.append(Prompt(id=pid, tokens=tokens, text=obj["text"] if has_text else None))
    if not prompts:
        raise UsageError(f"--prompts {name}: expected at least one prompt, the file has none")
    return prompts


def _read_prompt_source(spec: str) -> tuple[str, str]:
    if spec == BUNDLED_PROMPTS:
        from importlib.resources import files

        return f"{BUNDLED_PROMPTS} (tiered_kv/data/prompts.jsonl)", \
            files("tiered_kv").joinpath("data").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    if spec == "-":
        return "<stdin>", sys.stdin.read()
    path = Path(spec).expanduser()
    try:
        return spec, path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--prompts: no such file {spec!r} (expected a JSONL file, "
                         f"'{BUNDLED_PROMPTS}' or '-')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts: cannot read {spec!r}: {exc}") from None


def _check_tokens(where: str, tokens: object, vocab_size: int | None) -> list[int]:
    if not isinstance(tokens, list):
        raise UsageError(f"{where}: tokens: expected a list of integers, got {type(tokens).__name__}")
    hi = _MAX_TOKEN if vocab_size is None else vocab_size - 1
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
            raise UsageError(f"{where}: tokens[{i}]: expected an integer id in [0, {hi + 1}), got {t!r}"
                             + ("" if vocab_size is None else f" (the reference model's vocabulary is "
                                                              f"{vocab_size}; use \"text\" for byte-level ids)"))
    return tokens


def _check_unicode(where: str, text: str) -> None:
    """UsageError if ``text`` cannot be UTF-8 (a lone surrogate such as ``"\\ud800"``, which
    JSON escapes can spell): it could be neither tokenized nor printed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{where}: expected valid Unicode text, got a lone surrogate "
                         f"U+{ord(text[exc.start]):04X} at character {exc.start}") from None


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def show(value: object) -> str:
    """A short repr of a bad value for a message: bounded in length and nesting (a value
    from a file may be megabytes long or nested thousands deep)."""
    return _SHOW.repr(value)
