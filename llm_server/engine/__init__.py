"""The narrow engine interface the LLM tier needs, whatever runs the Orpheus backbone.

submit prompt ids + sampling -> stream generated token ids -> abort. vLLM's async engine
(vllm.py) is the backend; TensorRT-LLM's LLM API (trtllm.py) sits behind the same interface. The engine knows
nothing of voices, doors or speech: a LoRA voice reaches it as an Adapter, and whether LoRA is on at all is the
runtime's decision, given in the config (runtime.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling. `frame_constrained` turns on the audio-frame logits mask."""

    max_tokens: int
    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.1
    seed: int | None = None
    frame_constrained: bool = True


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter the engine applies to one voice's requests: a PEFT directory, and an id and a name unique
    to this version of it (an adapter replaced under the same name is a new adapter to the engine's cache)."""

    name: str
    id: int
    path: str


class EngineError(RuntimeError):
    """The engine failed a request (not the client's fault)."""


class Engine(Protocol):
    """What a speech stream asks of a backend (speech/stream.py)."""

    async def start(self) -> None:
        """Load the model and be ready to generate."""

    def generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str,
                 adapter: Adapter | None = None) -> AsyncIterator[list[int]]:
        """Stream the new token ids of one request (through LoRA `adapter`, if given); closing the iterator
        early aborts it."""

    async def load_adapter(self, adapter: Adapter) -> None:
        """Load a LoRA adapter for requests to use; EngineError saying why it cannot."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV cache."""

    def num_unfinished(self) -> int:
        """Requests the engine is still holding (running or waiting)."""

    def describe(self) -> dict[str, object]:
        """What runs the model, as the engine itself reports it (backend, runner, attention kernels)."""

    async def shutdown(self) -> None:
        """Stop the engine and release its memory."""
