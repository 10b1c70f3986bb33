"""``/v1/models``: the names this server answers to (``--served-model-name``), the LoRA adapters
it serves (each a model whose ``parent`` is the base), and their cards."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from tianxia.engine.async_engine import EngineClient
from tianxia.engine.engine_info import EngineInfo
from tianxia.engine.lora_manager import LoRARequest
from tianxia.server.errors import APIError


class ServingModels:
    """The served model under every name clients may use; the first name is the one reported."""

    def __init__(self, llm: EngineInfo, names: list[str]) -> None:
        self.llm = llm
        self.names = list(names)
        self.name = self.names[0]
        self.created = int(time.time())
        self._loading: set[str] = set()

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served (name -> path)."""
        return dict(self.llm.lora_adapters or {})

    def resolve(self, requested: str | None) -> str:
        """The reported name for a request's ``model`` (any served name or adapter, or none);
        else a 404."""
        if requested is None or requested in self.names:
            return self.name
        if requested in self.adapters():
            return requested
        raise APIError(
            404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a request's resolved ``model`` names, or None for the base. It carries the
        path, so that an engine core which has not loaded the adapter yet loads it."""
        if model in self.names:
            return None
        return LoRARequest(model, lora_path=self.adapters().get(model, ""))

    def card(self, name: str, adapter_path: str | None = None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tianxia",
            "root": adapter_path or str(self.llm.model_path),
            "parent": self.name if adapter_path else None,
            "max_model_len": self.llm.max_model_len,
        }

    def list_models(self) -> dict[str, Any]:
        cards = [self.card(n) for n in self.names]
        cards += [self.card(n, path) for n, path in self.adapters().items()]
        return {"object": "list", "data": cards}

    def retrieve(self, model_id: str) -> dict[str, Any]:
        adapters = self.adapters()
        if model_id in adapters:
            return self.card(model_id, adapters[model_id])
        if model_id not in self.names:
            raise APIError(
                404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
            )
        return self.card(model_id)

    # --- runtime adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) -----------

    async def load_lora_adapter(self, engine: EngineClient, data: dict[str, Any]) -> str:
        name, path = _text_field(data, "lora_name"), _text_field(data, "lora_path")
        adapters = self.llm.lora_adapters
        if adapters is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora")
        if name in adapters or name in self.names or name in self._loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        self._loading.add(name)  # a second load of the name while this one runs is refused
        try:
            # every engine core loads it (and checks it against the model)
            await engine.utility("add_lora", name, path)
        except Exception as e:
            # a core that did load it forgets it again, so the cores agree
            with contextlib.suppress(Exception):
                await engine.utility("remove_lora", name)
            if isinstance(e, ValueError):  # the file is bad for this model: the client's fault
                raise APIError(400, str(e), param="lora_path") from None
            raise
        finally:
            self._loading.discard(name)
        adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, engine: EngineClient, data: dict[str, Any]) -> str:
        name = _text_field(data, "lora_name")
        adapters = self.llm.lora_adapters
        if adapters is None or name not in adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="not_found")
        # gone for new requests at once; the ones running finish with it
        del adapters[name]
        await engine.utility("remove_lora", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def _text_field(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"`{key}` (a non-empty string) is required", param=key)
    return value
