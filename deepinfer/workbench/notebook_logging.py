"""deepinfer's log notices in a notebook: plain output, not the red error style.

Python's logging falls back to ``sys.stderr`` when nothing handles a record, and Jupyter
paints every stderr line as an error, so a harmless notice ("no tokenizer.json in ...;
using the bundled DeepSeek-V4 tokenizer") looked like a failure. In a kernel the
workbench gives the ``deepinfer`` logger one handler that writes records below ERROR to
stdout (plain text, prefixed with the level and logger) and errors to stderr (red, as
they should be). Outside a kernel (scripts, pytest) logging is left alone.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["NotebookLogHandler", "install_notebook_logging", "in_kernel"]


class NotebookLogHandler(logging.Handler):
    """Below ERROR -> the current ``sys.stdout``; ERROR and above -> the current ``sys.stderr``
    (looked up per record: the kernel swaps the streams per cell)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s [%(levelname)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.ERROR else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging must never break the engine
            self.handleError(record)


def in_kernel() -> bool:
    """Running inside an IPython kernel (JupyterLab, nbval, papermill)."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return get is not None and type(get()).__name__ == "ZMQInteractiveShell"


def install_notebook_logging(logger_name: str = "deepinfer", force: bool = False) -> NotebookLogHandler | None:
    """Add a :class:`NotebookLogHandler` to ``logger_name`` once, in a kernel (or with
    ``force``); returns it, or ``None`` when not in a kernel."""
    if not (force or in_kernel()):
        return None
    logger = logging.getLogger(logger_name)
    for h in logger.handlers:
        if isinstance(h, NotebookLogHandler):
            return h
    handler = NotebookLogHandler()
    logger.addHandler(handler)
    return handler
