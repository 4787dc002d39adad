"""Runs started from widget events: off the kernel's message loop, coalesced, with
progress, a time estimate and a cancel button.

A widget callback runs inside the kernel's message handler, so while one engine run
executes every further slider event waits in the kernel's queue and then starts a run of
its own (one queued run showed "running..." for 71 s with no way to stop it). A
:class:`RunQueue` instead runs the work on one worker thread and returns at once; events
that arrive meanwhile replace each other, so only the newest settings run next, and the
progress bar says how far the current run is, how long it still needs (from its own
rate so far) and how many events it superseded. **Cancel** stops the current run at its
next engine step (``LLM.generate`` aborts its requests on the way out) and drops the
pending one.

Runs started from code (``panel.run(...)``) stay on the calling thread; they first wait
for the worker, so the engine never runs two things at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as W

__all__ = ["RunCancelled", "RunQueue"]


class RunCancelled(Exception):
    """Raised inside the engine loop (from a step hook) when the user pressed Cancel."""


class RunQueue:
    """One worker thread, at most one pending run (the newest), progress and cancel widgets."""

    def __init__(self, label: str = "run") -> None:
        self.label = label
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="220px"))
        self.info = W.HTML(value="")
        self.cancel_button = W.Button(description="Cancel", disabled=True, layout=W.Layout(width="90px"))
        self.cancel_button.on_click(lambda _: self.cancel())
        self.widget = W.HBox([self.progress, self.cancel_button, self.info])
        self.errors: list[BaseException] = []
        self.superseded = 0  # events replaced by a newer one before they ran
        self.completed = 0
        self.cancelled = 0
        self._lock = threading.Lock()
        self._pending: Callable[[], Any] | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._t_start = 0.0

    @property
    def busy(self) -> bool:
        """A run is executing or waiting."""
        with self._lock:
            return self._thread is not None

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread while a run executes or waits, else ``None``."""
        with self._lock:
            return self._thread

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the worker now, or after the current run (replacing a waiting one)."""
        with self._lock:
            if self._thread is not None:
                if self._pending is not None:
                    self.superseded += 1
                self._pending = fn
                self.info.value = f"<i>{self.label} queued after the current one</i>"
                return
            self._pending = fn
            self._thread = threading.Thread(target=self._work, name=f"deepinfer-{self.label}", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until no run is executing or waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.label} still running after {timeout} s")

    def cancel(self) -> None:
        """Stop the current run at its next step and drop the waiting one."""
        with self._lock:
            self._pending = None
            if self._thread is not None:
                self._cancel.set()

    def check(self, done: float, total: float) -> None:
        """Called from inside a run (e.g. an engine step hook): update the bar and the
        estimate; raises :class:`RunCancelled` once Cancel was pressed."""
        if self._cancel.is_set() and threading.current_thread() is self._thread:
            raise RunCancelled(f"{self.label} cancelled")
        frac = min(done / total, 1.0) if total > 0 else 0.0
        self.progress.value = frac
        elapsed = time.perf_counter() - self._t_start
        left = elapsed * (1.0 - frac) / frac if frac > 0 else float("nan")
        extra = f", {self.superseded} superseded" if self.superseded else ""
        eta = f"about {left:.1f} s left" if left == left else "estimating..."
        self.info.value = f"{self.label}: {frac:.0%}, {elapsed:.1f} s, {eta}{extra}"

    def _work(self) -> None:
        while True:
            with self._lock:
                fn, self._pending = self._pending, None
                if fn is None:
                    self._thread = None
                    self._cancel.clear()
                    self.cancel_button.disabled = True
                    return
                self._cancel.clear()
            self.cancel_button.disabled = False
            self.progress.value, self._t_start = 0.0, time.perf_counter()
            try:
                fn()
                self.completed += 1
                self.progress.value = 1.0
                self.info.value = f"{self.label} done in {time.perf_counter() - self._t_start:.1f} s"
            except RunCancelled:
                self.cancelled += 1
                self.info.value = f"<b>{self.label} cancelled</b> after {time.perf_counter() - self._t_start:.1f} s"
            except BaseException as e:  # shown in the panel; kept for code that waits on the queue
                self.errors.append(e)
                self.info.value = f"<b>{self.label} failed:</b> {type(e).__name__}: {e}"
