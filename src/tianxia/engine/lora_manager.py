"""The adapters an engine serves: registration by name, an LRU of those held in memory, and the
per-request view the scheduler, the prefix cache and the runner need.

Each registration gets a slot id that never changes while it is registered (a reload of an
evicted adapter keeps it), so a sequence carries its slot, the runner's grouped product looks
its matrices up by slot, and the prefix cache keys blocks by it: equal tokens under two
adapters, or under one name registered twice with different files, are different K/V.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from tianxia.config import LoRAConfig
from tianxia.layers.lora import LoRAAdapter, LoRAError, LoRAState, adapter_dtype, load_peft_adapter, stack_adapters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: which adapter a request uses."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None


class LoRAUnknownError(KeyError, ValueError):
    """A request names an adapter that is not loaded (an HTTP client gets a 404)."""

    def __str__(self) -> str:
        return str(self.args[0])


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, max_rows: int = 0) -> None:
        """``max_rows``: the largest decode batch a CUDA graph replays (the stacked state's
        per-row buffer on a GPU)."""
        if not hasattr(model, "lora_targets"):
            raise ValueError(f"--enable-lora: {type(model).__name__} models serve no LoRA adapters")
        self.config = config
        self.capacity = config.max_cpu_loras or config.max_loras
        self.model_config = getattr(model, "config", None)
        param = next(model.parameters())
        self.device = param.device
        # a tensor-parallel model gives a state that puts each rank's shard of an adapter on it
        make_state = getattr(model, "lora_state", None)
        if make_state is not None:
            self.state: LoRAState = make_state()
        elif self.device.type == "cuda":
            from tianxia.layers.lora_stacked import StackedLoRAState

            # room for the resident adapters and as many again pinned by requests past the LRU's size
            self.state = StackedLoRAState(model, model.lora_targets(), positions=2 * self.capacity,
                                          max_rank=config.max_lora_rank, max_rows=max_rows,
                                          dtype=param.dtype, device=self.device)
        else:
            self.state = LoRAState(model, model.lora_targets())
        # the adapters' matrices: float16 over a packed CPU model (half the bytes a decode step
        # reads per adapter), else float32 (layers/lora.py adapter_dtype)
        self.dtype = adapter_dtype(model, self.state.targets) if type(self.state) is LoRAState else None
        # name -> the adapter files and their scales (several: their deltas are summed)
        self.sources: dict[str, tuple[tuple[str, float], ...]] = {}
        self.slot_of: dict[str, int] = {}
        # the slots whose adapter the state holds in memory: an LRU, most recent last
        self._resident: OrderedDict[int, None] = OrderedDict()
        self._slots = itertools.count()
        self.requests_total: Counter[str] = Counter()

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    @property
    def paths(self) -> dict[str, str]:
        """Each adapter's (first) file."""
        return {name: src[0][0] for name, src in self.sources.items()}

    def add(self, name: str, path: str | list[tuple[str, float]], pinned: set[int]) -> None:
        """Register (and load, to check it) an adapter: one path, or several (path, scale) whose
        deltas are summed; a bad one raises :class:`LoRAError`. ``pinned``: as for
        :meth:`acquire`."""
        if not name:
            raise LoRAError("an adapter needs a name")
        if name in self.sources:
            raise LoRAError(f"an adapter named {name!r} is already loaded")
        sources = ((path, 1.0),) if isinstance(path, str) else tuple(path)
        adapter = self._read(name, sources)
        slot = next(self._slots)
        self.sources[name], self.slot_of[name] = sources, slot
        self._hold(slot, adapter, pinned)
        logger.info("LoRA adapter %r (rank %d, %.1f MiB) from %s", name, adapter.rank, adapter.nbytes / 2**20,
                    ", ".join(p for p, _ in sources))

    def remove(self, name: str) -> bool:
        """Unregister an adapter; sequences already running with it finish with it."""
        if name not in self.sources:
            return False
        del self.sources[name]
        self.slot_of.pop(name)
        return True

    def acquire(self, name: str, pinned: set[int]) -> int:
        """The slot of adapter ``name`` for a new request, loading it back if it was evicted;
        ``pinned`` are the slots that running or waiting sequences use (never evicted)."""
        if name not in self.sources:
            raise LoRAUnknownError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slot_of[name]
        if slot in self._resident:
            self._resident.move_to_end(slot)
        else:
            self._hold(slot, self._read(name, self.sources[name]), pinned)
        self.requests_total[name] += 1
        return slot

    def _read(self, name: str, sources: tuple[tuple[str, float], ...]) -> LoRAAdapter:
        adapter = stack_adapters(name, [self._read_one(name, path, scale) for path, scale in sources])
        return adapter.to(self.device, self.dtype)

    def _read_one(self, name: str, path: str, scale: float) -> LoRAAdapter:
        """A PEFT directory, or llama.cpp's GGUF adapter file."""
        targets, max_rank = self.state.targets, self.config.max_lora_rank
        if path.endswith(".gguf"):
            from tianxia.loader.gguf_lora import load_gguf_adapter

            return load_gguf_adapter(name, path, self.model_config, targets, max_rank, scale)
        return load_peft_adapter(name, path, targets, max_rank, scale)

    def _hold(self, slot: int, adapter: LoRAAdapter, pinned: set[int]) -> None:
        self._resident[slot] = None
        self.state.put(slot, adapter)
        # evict the least recently used adapters no sequence needs, down to the capacity; the
        # pinned ones may keep it above (they are dropped once their sequences end and another
        # adapter comes in)
        for old in list(self._resident):
            if len(self._resident) <= self.capacity:
                break
            if old != slot and old not in pinned:
                del self._resident[old]
                self.state.drop(old)


__all__ = ["LoRAError", "LoRAManager", "LoRARequest", "LoRAUnknownError"]
