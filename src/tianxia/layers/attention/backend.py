"""The attention backend interface and its registry."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat batch.

    Sequences are ordered decodes first (one query token each), then prefills (chunks of a prompt,
    possibly continuing a cached prefix), so backends can treat the decodes as one dense batch.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: list[int]  # context length of each sequence after this step
    query_lens: list[int]  # new tokens of each sequence in this step
    query_start_loc: list[int]  # offsets into the flat batch, len num_seqs + 1
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64, same as seq_lens
    block_size: int
    # the decode attention's split count, fixed by a CUDA-graph capture (its grid cannot follow
    # the context lengths); None: the backend picks it from seq_lens
    num_splits: int | None = None
    # query_start_loc on the device (int64; the runner copies it with the step's other inputs);
    # None: a backend that needs it makes it
    query_start_tensor: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(ABC):
    """Computes attention for one layer and writes the layer's new K/V into its cache."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hk, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # a query at p sees keys p - window < pos <= p
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
        kv_scale: torch.Tensor | None = None,  # [2] float32: an fp8 cache's K and V scales
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that call an attention backend, one per layer, in layer order
    (the order of the model's KV caches)."""
    return [m for m in model.modules() if isinstance(getattr(m, "backend", None), AttentionBackend)]


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """Pick the backend for ``device`` (or the one named), importing it lazily."""
    import os

    from tianxia.layers.attention import cpu  # noqa: F401  (registers "torch")

    if name is None:
        name = os.environ.get("TIANXIA_ATTENTION_BACKEND") or None
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if name == "triton":
        from tianxia.layers.attention import triton_attention  # noqa: F401  (registers "triton")
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of PyTorch, not CPU ones)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken or mismatched install: fall back to the torch backend
        return False
    return True
