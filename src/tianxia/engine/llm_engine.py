"""The engine: requests in, one scheduled forward pass per :meth:`LLMEngine.step`, outputs out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from tianxia.config import EngineConfig
from tianxia.engine.block_manager import BlockManager
from tianxia.engine.detokenizer import IncrementalDetokenizer
from tianxia.engine.model_runner import ModelRunner, kv_bytes_per_token
from tianxia.engine.scheduler import Scheduler
from tianxia.engine.sequence import Sequence, SequenceStatus
from tianxia.layers.attention import get_backend
from tianxia.loader import load_model
from tianxia.outputs import CompletionOutput, RequestOutput
from tianxia.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def resolve_device(device: str) -> torch.device:
    if device in ("auto", ""):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    table = {
        "float32": torch.float32, "f32": torch.float32, "float": torch.float32,
        "float16": torch.float16, "f16": torch.float16, "half": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or default_threads())
        backend = get_backend(self.device)
        loaded = load_model(config.model, dtype=self.dtype, device=self.device, backend=backend)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = config.chat_template or loaded.chat_template
        self.model_path = loaded.path
        eos = list(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(eos)

        self.runner = ModelRunner(
            loaded.model, loaded.config, config.cache, self.device, self.dtype, seed=config.seed
        )
        self.runner.eos_ids = self.eos_ids
        capacity = self.runner.num_blocks * config.cache.block_size
        max_len = config.scheduler.max_model_len or loaded.config.max_position_embeddings
        if max_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        sched = config.scheduler
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        from dataclasses import replace

        self.scheduler = Scheduler(replace(sched, max_model_len=max_len), self.block_manager)
        self.requests: dict[str, list[Sequence]] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes/token); "
            "max concurrency at max_model_len=%d: %.1f",
            self.runner.num_blocks, config.cache.block_size, capacity,
            self.runner.kv_cache_bytes / 2**30, kv_bytes_per_token(loaded.config, self.dtype),
            max_len, capacity / max_len,
        )

    # --- requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token); "
                "shorten the prompt or raise --max-model-len"
            )
        seq = Sequence(request_id, text, ids, params)
        seq.detok = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop_strings, params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        self.requests[request_id] = [seq]
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        touched: dict[str, None] = {}
        for seq in out.rejected:
            seq.finish_reason = "abort"
            seq.stop_reason = "the request does not fit in the KV cache"
            self.scheduler.finish(seq)
            touched[seq.request_id] = None
        if out.scheduled:
            new_tokens = self.runner.execute(out.scheduled)
            now = time.monotonic()
            for seq, n in out.scheduled:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.num_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
                token = new_tokens.get(seq.seq_id)
                if token is None:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self.num_generation_tokens += 1
                seq.token_ids.append(token)
                self._check_stop(seq, token)
                touched[seq.request_id] = None
        return [self._output(rid) for rid in touched if rid in self.requests]

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        stop_str = seq.detok.append(token)
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif token in self.eos_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if stop_str is None:
                seq.detok.flush()
            self.scheduler.finish(seq)

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        finished = all(s.is_finished for s in seqs)
        first = seqs[0]
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.text,
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]
        result = RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
        )
        if finished:
            del self.requests[request_id]
        return result

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [len, vocab] of the model at every position of ``token_ids``.

        Runs through the same paged-attention path as generation, outside the scheduler.
        """
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len={self.max_model_len}")
        seq = Sequence("score", None, token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.can_allocate(seq, len(seq)):
            raise RuntimeError("not enough free KV blocks to score this sequence now")
        self.block_manager.allocate(seq, len(seq))
        try:
            return self.runner.prompt_logits(seq, self.scheduler.config.max_num_batched_tokens)
        finally:
            self.block_manager.free_seq(seq)

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
        }
