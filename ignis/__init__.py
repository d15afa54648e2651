"""ignis: one GPU decodes a hybrid Gated DeltaNet + attention model several times faster by speculative decoding.

The public API is vLLM-shaped: `LLM`, `AsyncLLM`, `SamplingParams`. Importing ignis starts nothing and loads no
model; the heavy modules are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ignis.params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputs", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from ignis.client.llm import LLM
    from ignis.client.async_llm import AsyncLLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from ignis.client.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from ignis.client.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
