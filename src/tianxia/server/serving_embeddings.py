"""``/v1/embeddings``: a decoder model's final hidden states, pooled, as vLLM's pooling runner
does for a generative model served with ``--task embed``.

Pooling (``--pooler-config``, vLLM's): ``LAST`` (the default, the last token's state, which has
seen the whole input) or ``MEAN`` (the average over every token), then L2-normalized unless
``normalize`` is false. Each input is one prompt pass through the engine, run on the engine
thread between steps (outside the scheduler, like ``LLMEngine.score``).
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tianxia.server.errors import APIError, bad_request
from tianxia.server.protocol import EmbeddingRequest
from tianxia.server.serving_base import OpenAIServing, random_id

POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """``--pooler-config '{"pooling_type": "MEAN", "normalize": false}'``."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--pooler-config is not JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {"pooling_type", "normalize"}:
            raise ValueError('--pooler-config takes {"pooling_type": ..., "normalize": ...}')
        kind = str(raw.get("pooling_type", "LAST")).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of {POOLING_TYPES}")
        return cls(kind, bool(raw.get("normalize", True)))


class OpenAIServingEmbedding(OpenAIServing):
    pooler = PoolerConfig()

    async def _inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        items = self.prompt_items(req.input)
        if not items:
            raise bad_request("input must not be empty", param="input")
        out = []
        for item in items:
            if isinstance(item, str):
                ids = await self.encode(item, bool(req.add_special_tokens), "input")
            else:
                ids = list(item)
                self.check_ids(ids, "input")
            if not ids:
                raise bad_request("input has an empty item", param="input")
            if len(ids) > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens; an "
                    f"input has {len(ids)} tokens.",
                    param="input",
                    code="context_length_exceeded",
                )
            out.append(ids)
        return out

    async def create(self, req: EmbeddingRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        if req.encoding_format not in ("float", "base64"):
            raise bad_request("encoding_format must be 'float' or 'base64'", param="encoding_format")
        if req.dimensions is not None:
            raise bad_request(
                "dimensions is not supported: the embeddings have the model's hidden size",
                param="dimensions",
                code="unsupported_parameter",
            )
        inputs = await self._inputs(req)
        self.check_accepting()
        normalize = self.pooler.normalize if req.normalize is None else req.normalize
        pooling = self.pooler.pooling_type
        try:
            vectors = await self.engine.utility("embed", inputs, pooling, normalize)
        except RuntimeError as e:  # no free KV blocks for now, or the engine stopped
            raise APIError(503, str(e), code="server_busy") from None
        data = []
        for i, vec in enumerate(vectors):
            if req.encoding_format == "base64":
                # as vLLM and OpenAI: the float32 values' little-endian bytes
                embedding: Any = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
            else:
                embedding = vec
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = sum(len(ids) for ids in inputs)
        return {
            "id": random_id("embd"),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
