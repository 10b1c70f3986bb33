"""What the prefix-aware router matches on: a request's prompt in token ids, chat template applied.

The replica's prefix cache holds token ids, so the router keys on the same thing (as SGLang's
router does in its token mode) rather than on text. The ingress loads only the model's tokenizer
and chat template, never its weights, and tokenizes at most the first ``max_chars`` characters of
the rendered prompt: routing needs the head of a prompt, not its tail.
"""

from __future__ import annotations

import json
from typing import Any


class RoutingTokenizer:
    def __init__(self, model: str, chat_template: str | None = None,
                 max_chars: int = 16384) -> None:
        from tianxia.loader.hub import resolve_model
        from tianxia.loader.tokenizer import load_tokenizer

        path = resolve_model(model)
        self.tokenizer = load_tokenizer(path, is_gguf=path.is_file())
        if chat_template is None and path.is_file():
            from tianxia.loader.gguf import GGUFFile

            chat_template = GGUFFile(path).chat_template()
        # the same template the replicas render with (theirs: --chat-template, the GGUF's, the
        # tokenizer's, in that order)
        self.chat_template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.max_chars = max_chars

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text[: self.max_chars], add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[Any], tools: Any) -> str | None:
        if self.chat_template is None:
            return None
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=True, **({"tools": tools} if tools else {}),
            )
        except Exception:  # noqa: BLE001 - a request the replica will reject with a 400 anyway
            return None

    def prompt_tokens(self, body: bytes) -> list[int]:
        """The prompt's token ids: a completion prompt (text or ids), or chat / Responses API
        messages under the chat template; [] when there is nothing to route on (the router then
        balances by load alone)."""
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return []
        if not isinstance(obj, dict):
            return []
        prompt = obj.get("prompt")
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and prompt and all(type(p) is int for p in prompt):
            return prompt
        messages = obj.get("messages") or obj.get("input")
        if isinstance(messages, str):
            return self._encode(messages)
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            text = self._render(messages, obj.get("tools"))
            return self._encode(text) if text else []
        return []
