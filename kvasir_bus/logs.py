"""Logging: structlog lines on stderr, JSON when read by a machine, readable on a terminal.

Call :func:`configure` once at the start of a command; then everywhere::

    log = structlog.get_logger().bind(node=node, layer=layer, expert=expert)
    log.info("served", request_id=req.request_id, rows=n, ms=round(dt * 1e3, 2))

Keep to the context names ``node``, ``layer``, ``expert``, ``request_id`` so that the lines of
all roles can be joined. Loggers are not cached, so :func:`capture` (structlog's
``capture_logs``) sees every line in tests, even from loggers bound at import time::

    with capture() as lines:
        ...
    assert lines[0]["event"] == "served"

Standard-library logging (nats-py, asyncio) goes through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.testing import capture_logs as capture

__all__ = ["configure", "capture", "LEVELS"]

LEVELS = ("debug", "info", "warning", "error", "critical")


class _Stderr:
    """Writes each rendered line to whatever ``sys.stderr`` is *now* (pytest swaps it)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _stderr_factory(*_args: Any) -> _Stderr:
    return _Stderr()


def configure(level: str = "info", json: bool | None = None) -> None:
    """Set up structlog (and the stdlib root logger) to write to stderr.

    ``level``: one of :data:`LEVELS`. ``json``: True for JSON lines, False for console
    output, None to choose by whether stderr is a terminal. Safe to call again.
    """
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    numeric = getattr(logging, name.upper())
    if json is None:
        json = not sys.stderr.isatty()

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True) if json
        else structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
    ]
    renderer: Any
    if json:
        renderer = structlog.processors.JSONRenderer()
        tail: list[Any] = [structlog.processors.StackInfoRenderer(),
                           structlog.processors.format_exc_info]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        tail = [structlog.processors.StackInfoRenderer()]

    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_stderr_factory,
        cache_logger_on_first_use=False,  # so capture() works on loggers made at import
    )

    # Route stdlib logging (nats-py, asyncio) through the same renderer, on stderr.
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, *tail],
    ))
    handler._kvasir = True  # type: ignore[attr-defined]  # ours: replaced on the next call
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_kvasir", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # gguf's writer narrates every file it writes at info level: not news to an operator.
    logging.getLogger("gguf").setLevel(max(numeric, logging.WARNING))
