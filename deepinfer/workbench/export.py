"""Figure export that works on an offline cluster: PNG / SVG through kaleido driving the
system's (Debian's) chromium, and standalone HTML with plotly.js embedded (no CDN).

kaleido 1.x renders in a headless Chrome/Chromium it finds on ``PATH`` (or at
``BROWSER_PATH``); it is never asked to download one here, so a machine without a browser
gets a clear error naming the fix instead of a network call.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import plotly.graph_objects as go

__all__ = ["FORMATS", "chromium_path", "export_figure"]

FORMATS = ("png", "svg", "html")

#: choreographer (kaleido's browser driver) logs a traceback at ERROR for a pipe message it
#: could not decode and then ignores; the export still succeeds, but the notebook shows the
#: traceback as red stderr output. Only that record is dropped: every other error still shows.
_IGNORED_PIPE_RECORD = "JSONError decoding message. Ignoring"


def _drop_ignored_pipe_errors(record: logging.LogRecord) -> bool:
    return _IGNORED_PIPE_RECORD not in record.getMessage()


def quiet_browser_pipe_log() -> None:
    """Drop choreographer's ignored-message tracebacks (idempotent)."""
    # logistro installs the logger class choreographer calls debug2() on: a logger created
    # before it by plain logging.getLogger would lack it and break the browser pipe
    import logistro

    pipe_logger = logistro.getLogger("choreographer.channels.pipe")
    if _drop_ignored_pipe_errors not in pipe_logger.filters:
        pipe_logger.addFilter(_drop_ignored_pipe_errors)


def chromium_path() -> str | None:
    """``BROWSER_PATH`` if set, else the first chromium / chrome on ``PATH``."""
    if os.environ.get("BROWSER_PATH"):
        return os.environ["BROWSER_PATH"]
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def export_figure(fig: go.Figure, path: str | os.PathLike[str], width: int | None = None, height: int | None = None,
                  scale: float = 2.0) -> Path:
    """Write ``fig`` to ``path``; the suffix picks the format (``.png``, ``.svg``, ``.html``).
    Images use the figure's size unless ``width`` / ``height`` are given; ``scale`` sharpens PNGs."""
    out = Path(path)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise ValueError(f"path suffix .{fmt}: must be one of {', '.join('.' + f for f in FORMATS)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        fig.write_html(out, include_plotlyjs=True, full_html=True)  # plotly.js inline: opens offline
        return out
    browser = chromium_path()
    if browser is None:
        raise RuntimeError("PNG / SVG export needs a chromium: `apt-get install chromium` (Debian) or set "
                           "BROWSER_PATH; HTML export needs nothing")
    os.environ.setdefault("BROWSER_PATH", browser)  # kaleido's browser lookup reads it
    quiet_browser_pipe_log()
    size = {"width": width or fig.layout.width or 900, "height": height or fig.layout.height or 500,
            "scale": scale if fmt == "png" else 1}
    for _ in range(RENDER_ATTEMPTS - 1):
        try:
            fig.write_image(out, format=fmt, **size)
            return out
        except Exception as exc:  # noqa: BLE001 - only the tab's start-up race is retried
            if not _render_script_missing(exc):
                raise
    fig.write_image(out, format=fmt, **size)  # the last attempt: its error is the caller's
    return out


#: On a loaded machine kaleido may call its render function before the tab's script defined
#: it ("ReferenceError: kaleido_scopes is not defined"); a fresh render then succeeds.
RENDER_ATTEMPTS = 3


def _render_script_missing(exc: BaseException) -> bool:
    return type(exc).__name__ == "JavascriptError" and "is not defined" in str(exc)
