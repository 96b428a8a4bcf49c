"""Helpers shared by the store commands (``warm-start``, ``stats``, ``verify``, ``gc``, ``ls``...),
one module per concern, re-exported here (the commands call them as ``_common.X``):

==============  ===========================================================================
_failures.py    :class:`CommandFailed` (an exit code and a message), :func:`run_guarded`
_args.py        ``--store`` and the layout options (``--model`` plus ``--entry-format`` /
                ``--indexer-bytes`` / ``--block-tokens``, as ``plan`` has them; optional
                for commands that compute no KV: :func:`layout_option`), argparse types
_layouts.py     layouts and writers in words: the options of a fingerprint, its preset, the
                model a cache salted its keys with, a store's writer record
_stores.py      ``--store`` parsing (:func:`parse_store`, the resolver ``open_store`` uses:
                :func:`tiered_kv.storage.urls.resolve`), :func:`open_cli_store` (a repeated
                ``--store`` opens a chain, nearest first), store errors -> documented exit
                codes (:func:`store_errors`: missing 3, foreign layout 4, locked 5,
                unreadable 1)
_prompts.py     prompt files (:func:`load_prompts`): JSONL of ``{"id", "tokens"}`` or
                ``{"id", "text"}``
_output.py      JSON output, ISO times, a progress bar (:class:`Progress`) on stderr when it
                is a terminal
==============  ===========================================================================

Module-level imports stay light (no torch, no stores): every command module is imported
on every ``tiered-kv`` invocation.
"""

from __future__ import annotations

from ._args import (
    ENTRY_FORMATS,
    add_layout_args,
    add_store_arg,
    layout_from_args,
    layout_option,
    positive_int,
    seconds_arg,
    size_arg,
)
from ._failures import CommandFailed, run_guarded
from ._layouts import (
    cache_model_id,
    describe_writer,
    hashing_layout,
    layout_hint,
    layout_options,
    model_of,
    preset_layout,
)
from ._output import Progress, iso_time, print_json, quiet_logger
from ._prompts import BUNDLED_PROMPTS, Prompt, load_prompts, prompts_arg_help, show
from ._stores import (
    Backend,
    StoreLocation,
    index_damaged_message,
    missing_store,
    open_cli_store,
    parse_store,
    report_index_rebuild,
    store_errors,
    store_url,
)
from .main import UsageError

__all__ = [
    "BUNDLED_PROMPTS",
    "ENTRY_FORMATS",
    "Backend",
    "CommandFailed",
    "Progress",
    "Prompt",
    "StoreLocation",
    "UsageError",
    "add_layout_args",
    "add_store_arg",
    "cache_model_id",
    "describe_writer",
    "hashing_layout",
    "index_damaged_message",
    "iso_time",
    "layout_from_args",
    "layout_hint",
    "layout_option",
    "layout_options",
    "load_prompts",
    "missing_store",
    "model_of",
    "open_cli_store",
    "parse_store",
    "positive_int",
    "preset_layout",
    "print_json",
    "prompts_arg_help",
    "quiet_logger",
    "report_index_rebuild",
    "run_guarded",
    "seconds_arg",
    "show",
    "size_arg",
    "store_errors",
    "store_url",
]
