"""``/v1/models``: the names this server answers to (``--served-model-name``) and their cards."""

from __future__ import annotations

import time
from typing import Any

from tianxia.engine.engine_info import EngineInfo
from tianxia.server.errors import APIError


class ServingModels:
    """The served model under every name clients may use; the first name is the one reported."""

    def __init__(self, llm: EngineInfo, names: list[str]) -> None:
        self.llm = llm
        self.names = list(names)
        self.name = self.names[0]
        self.created = int(time.time())

    def resolve(self, requested: str | None) -> str:
        """The reported name for a request's ``model`` (any served name, or none); else a 404."""
        if requested is None or requested in self.names:
            return self.name
        raise APIError(
            404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
        )

    def card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tianxia",
            "root": str(self.llm.model_path),
            "parent": None,
            "max_model_len": self.llm.max_model_len,
        }

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(n) for n in self.names]}

    def retrieve(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.names:
            raise APIError(
                404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
            )
        return self.card(model_id)
