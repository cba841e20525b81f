"""``--log.level`` and ``--log.format`` as the Prometheus exporters have them (promslog).

``logfmt`` (default) writes ``time=... level=INFO source=kvsidecar.daemon.target msg="..."``,
``json`` one object per line. The level is upper-case, as promslog writes it (Go's log/slog
handlers: DEBUG, INFO, WARN, ERROR, in Prometheus 3 and the exporters built on it); the
``--log.level`` values stay lower-case, as promslog's flag has them. Either way every control
character of a message is escaped (`kvsidecar.cli.options.printable`): log lines carry
engine-supplied strings (segment errors, decode messages), and a raw ESC or CR would reach
whoever tails the log.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

import click

from kvsidecar import settings
from kvsidecar.printable import printable

LEVELS = ("debug", "info", "warn", "error")
FORMATS = ("logfmt", "json")
_PY_LEVEL = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
             "warning": logging.WARNING, "error": logging.ERROR}  # fmt: skip
_NAME = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARN",
         logging.ERROR: "ERROR", logging.CRITICAL: "ERROR"}  # fmt: skip
_BARE = re.compile(r"[^\s\"=\\]+")  # a logfmt value that needs no quotes


def _time(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _logfmt_value(value: str) -> str:
    if _BARE.fullmatch(value):
        return value
    return '"' + value.replace('"', '\\"') + '"'


class LogfmtFormatter(logging.Formatter):
    """One logfmt line per record: bare values where possible, else quoted with ``\\"``."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += " " + " | ".join(self.formatException(record.exc_info).splitlines())
        fields = [
            ("time", _time(record)),
            ("level", _NAME.get(record.levelno, "INFO")),
            ("source", record.name),
            # Angle form (<0x1b>), not backslashes: logfmt parsers disagree on escapes
            # other than \", so a backslash-free value reads back the same everywhere.
            ("msg", printable(msg, style="angle")),
        ]
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields)


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        out: dict[str, Any] = {
            "time": _time(record),
            "level": _NAME.get(record.levelno, "INFO"),
            "source": record.name,
            "msg": printable(msg),
        }
        if record.exc_info:
            out["error"] = printable(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


def log_options(f: Any) -> Any:
    f = click.option(
        "--log.format",
        "log_format",
        type=click.Choice(FORMATS),
        default=settings.LOG_FORMAT.default,
        show_default=True,
        envvar=settings.LOG_FORMAT.name,
        help="Log line format.",
    )(f)
    return click.option(
        "--log.level",
        "--log-level",  # the pre-0.2 spelling, still accepted
        "log_level",
        type=click.Choice([*LEVELS, "warning"], case_sensitive=False),
        default=settings.LOG_LEVEL.default,
        show_default=True,
        envvar=settings.LOG_LEVEL.name,
        help="Only log messages with this severity or above.",
    )(f)


def setup_logging(level: str, fmt: str = "logfmt", stream: Any = None) -> None:
    """Route every ``kvsidecar.*`` logger to stderr in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(_PY_LEVEL[level.lower()])
