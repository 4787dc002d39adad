"""deepinfer: an inference engine and JupyterLab workbench for DeepSeek-V4 models.

    from deepinfer import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "__version__"]

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.llm import LLM
    from deepinfer.outputs import RequestOutput
    from deepinfer.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: `import deepinfer` stays cheap (no torch import)
    if name == "LLM":
        from deepinfer.llm import LLM
        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling_params import SamplingParams
        return SamplingParams
    if name == "RequestOutput":
        from deepinfer.outputs import RequestOutput
        return RequestOutput
    if name == "EngineConfig":
        from deepinfer.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
