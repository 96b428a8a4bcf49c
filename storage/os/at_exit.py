"""Closing stores and caches left open at interpreter exit, before Python's thread pools stop.

A process that ends without ``cache.shutdown()`` / ``store.close()`` still has writes
queued on background threads (a cache's disk writer, a chain's uploads) that need thread
pools to finish. The order of a normal exit in CPython (``Py_FinalizeEx``) is::

    1. threading._shutdown(): the callbacks of threading._register_atexit, newest first;
       among them concurrent.futures.thread._python_exit, registered when that module is
       imported, which makes every ThreadPoolExecutor refuse new work ("cannot schedule
       new futures after interpreter shutdown") and joins their threads;
       then the non-daemon threads are joined
    2. atexit handlers

So a store closed from an ``atexit`` handler, or a writer thread still running when
``_python_exit`` ran, finds its pools closed: a queued write fails, an upload logs a
traceback. Objects register here instead (:func:`close_at_exit`); one callback, registered
with ``threading._register_atexit`` *after* ``concurrent.futures.thread`` is imported (so
it runs *before* ``_python_exit``), closes them while every pool still works, newest
first: a cache's disk tier (its queued writes land) before the store chain under it (its
promotions land, uploads go on for its ``close_timeout_s``, the rest stays journaled).

Registrations hold weak references (an object collected earlier is skipped) and are
removed by the object's own ``close()``. A close that fails at exit is logged on one line
(never a traceback) and the others still run. Threads of the program that still use such
an object at that point (non-daemon threads are joined only afterwards) find it closed.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["ExitRegistration", "close_at_exit"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_hooks: dict[int, weakref.WeakMethod[Callable[[], Any]]] = {}
_order = itertools.count()
_installed = False


class ExitRegistration:
    """A pending close-at-exit; :meth:`cancel` it when the object is closed normally."""

    __slots__ = ("_token",)

    def __init__(self, token: int) -> None:
        self._token = token

    def cancel(self) -> None:
        """Forget the registration (idempotent)."""
        with _lock:
            _hooks.pop(self._token, None)


def close_at_exit(method: Callable[[], Any]) -> ExitRegistration:
    """Call the bound ``method`` (e.g. ``store.close``) at interpreter exit, before thread
    pools stop accepting work, unless the registration was cancelled or its object
    collected first. Later registrations run first."""
    if getattr(method, "__self__", None) is None:
        raise TypeError(f"method: expected a bound method (a weak reference is kept), got {method!r}")
    _install()
    with _lock:
        token = next(_order)
        _hooks[token] = weakref.WeakMethod(method)
    return ExitRegistration(token)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    # Importing it registers _python_exit (once per process); registered after it, ours runs first.
    importlib.import_module("concurrent.futures.thread")
    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
    if register is None:  # another interpreter: the nearest hook it offers
        atexit.register(_run)
        return
    try:
        register(_run)
    except RuntimeError:  # the interpreter is already exiting: nothing can be registered
        pass


def _run() -> None:
    """Close every registered object, newest first. Never raises: an exception here would
    skip the interpreter's own exit callbacks."""
    with _lock:
        pending = [_hooks.pop(token) for token in sorted(_hooks, reverse=True)]
    for ref in pending:
        method = ref()
        if method is None:
            continue
        try:
            method()
        except BaseException as exc:  # noqa: BLE001 - at exit: report on one line, close the rest
            owner = type(getattr(method, "__self__", None)).__name__
            log.warning("closing a %s at interpreter exit failed: %s: %s", owner, type(exc).__name__, exc)
