"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt or chat messages to token ids, and back."""

from __future__ import annotations

from typing import Any

from tianxia.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from tianxia.server.serving_base import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        """``{"prompt": ...}`` or ``{"messages": [...]}`` (rendered as a chat would be)."""
        if "messages" in data:
            req = TokenizeChatRequest.model_validate(data)
            self.check_model(req.model)
            _, ids = await self.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
                add_special_tokens=req.add_special_tokens,
            )
        else:
            req = TokenizeCompletionRequest.model_validate(data)
            self.check_model(req.model)
            ids = await self.encode(req.prompt, req.add_special_tokens, "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def detokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        req = DetokenizeRequest.model_validate(data)
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}
