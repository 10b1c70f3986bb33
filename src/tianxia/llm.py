"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from tianxia.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size
from tianxia.engine.llm_engine import LLMEngine, PromptType
from tianxia.outputs import RequestOutput
from tianxia.sampling_params import SamplingParams


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``model`` is a pulled name (``smollm2-135m``), a ``.gguf`` path or a Hugging Face directory.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: str | int = "2GiB",
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            threads=threads,
            seed=seed,
            chat_template=chat_template,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=parse_size(kv_cache_memory),
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len or 0,
            ),
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("sampling_params must be one object or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        template = chat_template or self.engine.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template; pass chat_template= (or --chat-template)"
            )
        text = self.engine.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        # the template already renders BOS where the model wants it
        return self.engine.tokenizer.encode(text, add_special_tokens=False)
