"""Kernel tests run Triton's CPU interpreter unless a GPU run asks otherwise
(TRITON_INTERPRET=0 on a CUDA machine). The variable must be set before any kernel
module is imported: `triton.jit` reads it when it decorates."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
