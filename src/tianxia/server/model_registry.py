"""The models one server answers for, and the engine behind each: the single model of a plain
``tianxia serve MODEL``, or several named models (``--model NAME=MODEL``, ``--models-dir``) that
load on demand and unload least recently used first, as llama.cpp's router mode does (in one
process here: each loaded model is its own :class:`AsyncLLMEngine` on its own thread).

The endpoints ask :meth:`ModelRegistry.use` for the handlers of a request's ``model``; everything
about loading, unloading and memory lives here. Loads run one at a time (each in a thread of its
own, so the event loop keeps serving the loaded models), so the memory plan is always computed
against a settled set of loaded models. A model is never unloaded while a request to it runs: a
request holds a lease from the moment it picks its model until its handler returns, and after
that the engine counts its streams until they end.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tianxia.engine.async_engine import run_in_own_thread
from tianxia.server.errors import APIError

if TYPE_CHECKING:
    from tianxia.server.api import Servings

logger = logging.getLogger(__name__)

_MIB = 1 << 20
# what a loaded model holds besides its weights and KV cache (activations, logits, allocator
# slack, its engine thread's pools); counted in each model's share of the memory plan
MODEL_OVERHEAD_BYTES = 128 * _MIB


def _mib(n: int) -> str:
    return f"{n / _MIB:.0f} MiB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _not_found(name: str | None, param: str = "model") -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param=param, code="model_not_found"
    )


@dataclass
class ModelEntry:
    """One servable model and where it stands: ``unloaded``, ``loading``, ``loaded``, ``failed``."""

    name: str
    spec: str  # what the loader resolves: a pulled name, a .gguf path or a HF directory
    aliases: tuple[str, ...] = ()
    state: str = "unloaded"
    reason: str | None = None  # why the last load failed
    servings: Servings | None = None
    weight_bytes: int | None = None  # measured at its last load; an estimate before the first
    kv_bytes: int = 0
    last_used: float = 0.0
    leases: int = 0  # requests that picked this model and whose handlers still run
    loading: asyncio.Task | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def busy(self) -> int:
        """Requests to it that are running: a request holds a lease while its handler runs and
        is in its engine from when it is added until its output is sent (a stream's after the
        handler returned), so each request is counted by one or both."""
        running = self.servings.engine.num_unfinished if self.servings is not None else 0
        return max(self.leases, running)


@dataclass
class MemoryPlan:
    """What loaded models may hold together: ``budget`` bytes (None: no limit but
    ``--models-max``), each model counted as weights + its KV cache + an overhead."""

    budget: int | None
    estimate_weights: Callable[[str], int]

    def need(self, entry: ModelEntry) -> tuple[int, int]:
        """(bytes the model takes, its weights' part)."""
        weights = entry.weight_bytes
        if weights is None:
            weights = entry.weight_bytes = self.estimate_weights(entry.spec)
        return weights + entry.kv_bytes + MODEL_OVERHEAD_BYTES, weights


ServingsFactory = Callable[[ModelEntry], "Servings"]


class ModelRegistry:
    """Model name -> the handlers (:class:`Servings`) of its engine, loading and unloading.

    ``router`` is False for a plain single-model server: its one model is loaded at start, never
    unloaded, and answers every served name (and a request without ``model``) as before.
    """

    def __init__(
        self,
        entries: list[ModelEntry],
        build: ServingsFactory | None = None,
        *,
        router: bool = True,
        max_loaded: int = 4,
        autoload: bool = True,
        plan: MemoryPlan | None = None,
        load_timeout: float = 600.0,
        on_unload: Callable[[ModelEntry], None] | None = None,
        check: Callable[[ModelEntry], object] | None = None,
    ) -> None:
        if not entries:
            raise ValueError("no models to serve")
        self.entries = entries
        self.by_name: dict[str, ModelEntry] = {}
        for e in entries:
            for n in e.names:
                if n in self.by_name:
                    raise ValueError(f"two models are named {n!r}")
                self.by_name[n] = e
        self.build = build
        self.router = router
        self.max_loaded = max_loaded
        self.autoload = autoload
        self.plan = plan or MemoryPlan(None, lambda spec: 0)
        self.load_timeout = load_timeout
        self.on_unload = on_unload
        self.check = check  # a cheap look at the model (its header) before room is made for it
        self._load_lock = asyncio.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def single(cls, servings: Servings) -> ModelRegistry:
        names = servings.models.names
        entry = ModelEntry(names[0], names[0], tuple(names[1:]), state="loaded", servings=servings)
        return cls([entry], router=False)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engines of the models loaded before the event loop ran (the single model)."""
        self.loop = asyncio.get_running_loop()
        for e in self.entries:
            if e.servings is not None:
                e.servings.engine.start()

    async def shutdown(self) -> None:
        for e in self.entries:
            if e.servings is not None:
                await e.servings.engine.shutdown()

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "loaded"]

    # --- finding a model ----------------------------------------------------------------------

    def find(self, name: str | None, param: str = "model") -> ModelEntry:
        """The model a request names (any of its names); without a name, the only model."""
        if not self.router:  # its handlers check the name, as they always have
            return self.default
        if name is None:
            if len(self.entries) == 1:
                return self.default
            raise APIError(
                400,
                "This server serves several models; name one in `model`: "
                + ", ".join(e.name for e in self.entries),
                param=param,
                code="model_required",
            )
        entry = self.by_name.get(name)
        if entry is None:
            raise _not_found(name, param)
        return entry

    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Servings]:
        """The handlers of the named model, loaded first if need be; the model stays loaded
        until the block ends (and, for a stream, until the stream ends)."""
        entry = self.find(name)
        while entry.state != "loaded":  # (another load may evict it between its load and here)
            await self._ready(entry)
        assert entry.servings is not None
        entry.leases += 1
        entry.last_used = time.monotonic()
        try:
            yield entry.servings
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()

    async def _ready(self, entry: ModelEntry) -> None:
        if entry.state == "failed":
            raise APIError(
                503,
                f"The model `{entry.name}` failed to load: {entry.reason}. "
                "Fix it and POST /models/load to retry.",
                param="model",
                code="model_load_failed",
            )
        if entry.state == "unloaded" and not self.autoload:
            raise APIError(
                503,
                f"The model `{entry.name}` is not loaded and this server loads models only when "
                "asked (--no-models-autoload): POST /models/load first.",
                param="model",
                code="model_not_loaded",
            )
        try:
            await asyncio.wait_for(asyncio.shield(self._load_task(entry)), self.load_timeout)
        except asyncio.TimeoutError:
            raise APIError(
                503,
                f"The model `{entry.name}` is still loading after {self.load_timeout:g}s "
                "(--models-load-timeout); retry later.",
                param="model",
                code="model_loading",
                headers={"Retry-After": "5"},
            ) from None

    # --- loading ------------------------------------------------------------------------------

    def _load_task(self, entry: ModelEntry) -> asyncio.Task:
        """The load in progress of ``entry``, started if none is: every waiter shares it."""
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
            # a load whose waiters all gave up still ends; its error is in the model's status
            entry.loading.add_done_callback(lambda t: t.cancelled() or t.exception())
        return entry.loading

    async def load(self, name: str) -> ModelEntry:
        """``POST /models/load``: load a model that is not loaded (waiting for it)."""
        entry = self.find(name)
        if entry.state == "loaded":
            raise APIError(
                400, f"The model `{entry.name}` is already loaded.", param="model",
                code="model_already_loaded",
            )
        await asyncio.shield(self._load_task(entry))
        return entry

    async def _load(self, entry: ModelEntry) -> None:
        try:
            async with self._load_lock:
                if entry.state == "loaded":
                    return
                entry.state, entry.reason = "loading", None
                started = time.monotonic()
                check, build = self.check, self.build
                assert build is not None  # a single-model registry never loads
                if check is not None:  # a bad file fails here, before others unload for it
                    await self._attempt(entry, lambda: check(entry))
                await self._make_room(entry)
                servings = await self._attempt(entry, lambda: build(entry))
                servings.engine.start()
                entry.servings, entry.state = servings, "loaded"
                entry.weight_bytes = weight_bytes(servings)
                entry.last_used = time.monotonic()
                logger.info(
                    "loaded model %s (%s) in %.1fs: weights %s, KV cache %s; %d of %d loaded%s",
                    entry.name, entry.spec, time.monotonic() - started, _mib(entry.weight_bytes),
                    _mib(entry.kv_bytes), len(self.loaded()), self.max_loaded, self._plan_text(),
                )
        finally:
            entry.loading = None
            if entry.state == "loading":  # refused for room: it stays as it was
                entry.state = "unloaded"

    async def _attempt(self, entry: ModelEntry, step: Callable[[], Any]) -> Any:
        """``step()`` of a load, in a thread of its own; if it raises, the model is failed."""
        try:
            return await run_in_own_thread(step)
        except Exception as e:  # noqa: BLE001 - any load failure marks the model failed
            entry.state, entry.reason = "failed", _first_line(e)
            entry.weight_bytes = None
            logger.error("model %s (%s) failed to load: %s", entry.name, entry.spec, entry.reason)
            raise APIError(
                503,
                f"The model `{entry.name}` failed to load: {entry.reason}",
                param="model",
                code="model_load_failed",
            ) from None

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload idle models, least recently used first, until ``entry`` fits under
        ``--models-max`` and the memory plan; wait for busy ones up to the load timeout."""
        need, weights = self.plan.need(entry)
        budget = self.plan.budget
        if budget is not None and need > budget:
            raise APIError(
                503,
                f"The model `{entry.name}` does not fit in memory: it needs {_mib(need)} "
                f"(weights {_mib(weights)} + KV cache {_mib(entry.kv_bytes)} + "
                f"{_mib(MODEL_OVERHEAD_BYTES)} overhead) and the models may hold {_mib(budget)} "
                "in all (--models-memory); lower --kv-cache-memory or raise --models-memory.",
                param="model",
                code="model_does_not_fit",
            )
        deadline = time.monotonic() + self.load_timeout
        while True:
            loaded = self.loaded()
            held = sum(self.plan.need(e)[0] for e in loaded)
            too_many = len(loaded) + 1 > self.max_loaded
            too_big = budget is not None and held + need > budget
            if not (too_many or too_big):
                return
            idle = sorted((e for e in loaded if not e.busy), key=lambda e: e.last_used)
            if idle:
                why = "--models-max" if too_many else "memory"
                await self._unload(idle[0], f"least recently used, to make room ({why}) for "
                                            f"{entry.name}")
                continue
            if time.monotonic() >= deadline:
                running = ", ".join(f"{e.name}: {e.busy} running" for e in loaded)
                limit = (
                    f"{len(loaded)} loaded of --models-max {self.max_loaded}"
                    if too_many
                    else f"{entry.name} needs {_mib(need)}, the loaded models hold {_mib(held)} "
                    f"of {_mib(budget or 0)} (--models-memory)"
                )
                raise APIError(
                    503,
                    f"Cannot load the model `{entry.name}`: {limit}, and every loaded model is "
                    f"serving requests ({running}); retry later.",
                    param="model",
                    code="models_busy",
                    headers={"Retry-After": "5"},
                )
            await asyncio.sleep(0.05)  # a busy model frees up when its last request ends

    def _plan_text(self) -> str:
        if self.plan.budget is None:
            return ""
        held = sum(self.plan.need(e)[0] for e in self.loaded())
        return f"; memory plan {_mib(held)} of {_mib(self.plan.budget)}"

    # --- unloading ----------------------------------------------------------------------------

    async def unload(self, name: str) -> ModelEntry:
        """``POST /models/unload``: unload a loaded model that no request is using."""
        entry = self.find(name)
        if not self.router:
            raise APIError(400, "A single-model server does not unload its model.",
                           code="model_pinned")
        async with self._load_lock:
            if entry.state != "loaded":
                raise APIError(
                    400, f"The model `{entry.name}` is not loaded ({entry.state}).",
                    param="model", code="model_not_loaded",
                )
            if entry.busy:
                raise APIError(
                    409,
                    f"The model `{entry.name}` is serving {entry.busy} request(s); retry when "
                    "they have finished.",
                    param="model",
                    code="model_busy",
                )
            await self._unload(entry, "asked")
        return entry

    async def _unload(self, entry: ModelEntry, why: str) -> None:
        servings, entry.servings = entry.servings, None
        entry.state = "unloaded"
        if servings is None:
            return
        before = rss_bytes()
        if self.on_unload is not None:
            self.on_unload(entry)
        await servings.engine.shutdown()
        del servings
        release_memory()
        logger.info("unloaded model %s (%s): resident memory %s -> %s", entry.name, why,
                    _mib(before), _mib(rss_bytes()))

    def engine_died(self, entry: ModelEntry, exc: BaseException) -> None:
        """A loaded model's engine loop crashed: it is marked failed; the others keep serving."""
        if entry.state != "loaded":
            return
        entry.state, entry.reason = "failed", f"its engine stopped: {_first_line(exc)}"
        servings, entry.servings = entry.servings, None
        if self.on_unload is not None:
            self.on_unload(entry)
        if servings is not None:
            asyncio.ensure_future(servings.engine.shutdown())

    # --- /v1/models ---------------------------------------------------------------------------

    def card(self, entry: ModelEntry, name: str) -> dict[str, Any]:
        if entry.servings is not None and not self.router:
            return entry.servings.models.card(name)
        status: dict[str, Any] = {"value": entry.state}
        if entry.state == "failed":
            status.update(failed=True, reason=entry.reason)
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": entry.created,
            "owned_by": "tianxia",
            "root": entry.spec,
            "parent": None,
            "aliases": list(entry.aliases),
            "status": status,
        }
        if entry.servings is not None:
            llm = entry.servings.engine.engine
            card["root"] = str(llm.model_path)
            card["max_model_len"] = llm.max_model_len
            card["memory_bytes"] = {"weights": entry.weight_bytes, "kv_cache": entry.kv_bytes}
        return card

    def list_models(self) -> dict[str, Any]:
        if not self.router:
            return self.default.servings.models.list_models()  # type: ignore[union-attr]
        return {"object": "list", "data": [self.card(e, e.name) for e in self.entries]}

    def retrieve(self, model_id: str) -> dict[str, Any]:
        if not self.router:  # its served names and LoRA adapters
            return self.default.servings.models.retrieve(model_id)  # type: ignore[union-attr]
        entry = self.by_name.get(model_id)
        if entry is None:
            raise _not_found(model_id)
        return self.card(entry, model_id)


def weight_bytes(servings: Servings) -> int:
    """Bytes of the loaded model's parameters and buffers (packed quantized weights are buffers)."""
    model = servings.engine.engine.runner.model
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rss_bytes() -> int:
    from tianxia.engine.llm_engine import rss_bytes as rss

    return rss()


def release_memory() -> None:
    """Give an unloaded model's memory back: collect its cycles, then return freed heap pages
    to the system (glibc keeps them otherwise) and the CUDA allocator's cached blocks."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
