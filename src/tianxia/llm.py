"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from tianxia.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig, parse_size
from tianxia.engine.llm_engine import LLMEngine, PromptType
from tianxia.engine.lora_manager import LoRARequest
from tianxia.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from tianxia.sampling_params import BeamSearchParams, SamplingParams


def beam_search_score(tokens: list[int], cum_logprob: float, eos_id: int | None, length_penalty: float) -> float:
    """vLLM's beam score: cumulative logprob over length ** length_penalty (length without EOS)."""
    length = len(tokens) - (1 if eos_id is not None and tokens and tokens[-1] == eos_id else 0)
    return cum_logprob / (length**length_penalty)


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
        gpu_memory_utilization: float | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
        chat_template: str | None = None,
        quantization: str = "auto",
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool | None = None,
        cpu_activations: str = "int8",
        batch_invariant: bool = False,
        speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
        cpu_offload_gb: float = 0.0,
        n_gpu_layers: int | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            threads=threads,
            seed=seed,
            chat_template=chat_template,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            cpu_activations=cpu_activations,
            batch_invariant=batch_invariant,
            async_scheduling=async_scheduling,
            speculative=SpeculativeConfig.parse(speculative_config),
            tensor_parallel_size=tensor_parallel_size,
            cpu_offload_gb=cpu_offload_gb,
            n_gpu_layers=n_gpu_layers,
            master_addr=master_addr,
            master_port=master_port,
            nnodes=nnodes,
            node_rank=node_rank,
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=parse_size(kv_cache_memory),
                enable_prefix_caching=enable_prefix_caching,
                num_blocks=num_kv_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
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
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.
        ``lora_request``: one adapter for every prompt, or one (or None: the base) per prompt."""
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
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError("lora_request must be one LoRARequest or one per prompt")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, lora)
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

    def beam_search(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search as vLLM's offline API does it: each step asks the engine for one token and
        the top ``2 * beam_width`` log-probabilities of every live beam; the prefix cache makes
        each step compute only the beams' newest tokens."""
        eos = self.engine.tokenizer.eos_token_id
        width = params.beam_width
        step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
        instances = []
        for prompt in prompts:
            _, ids = self.engine.tokenize_prompt(prompt)
            instances.append(([BeamSearchSequence(tokens=list(ids), logprobs=[])], [], len(ids)))

        def score(beam: BeamSearchSequence) -> float:
            return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

        steps = range(params.max_tokens)
        for _ in tqdm(steps, desc="Beam search", disable=not use_tqdm):
            live = [(i, b) for i, (beams, _, _) in enumerate(instances) for b in beams]
            if not live:
                break
            outs = self.generate(
                [{"prompt_token_ids": b.tokens} for _, b in live], step_params, use_tqdm=False
            )
            candidates: list[list[BeamSearchSequence]] = [[] for _ in instances]
            for (i, beam), out in zip(live, outs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    new = BeamSearchSequence(
                        tokens=beam.tokens + [token],
                        logprobs=beam.logprobs + [out.outputs[0].logprobs[0]],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if token == eos and not params.ignore_eos:
                        new.finish_reason = "stop"
                        instances[i][1].append(new)
                    else:
                        candidates[i].append(new)
            instances = [
                (sorted(cands, key=score, reverse=True)[:width], done, n)
                for cands, (_, done, n) in zip(candidates, instances)
            ]
        results = []
        tok = self.engine.tokenizer
        for beams, done, n_prompt in instances:
            for beam in beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(done + beams, key=score, reverse=True)[:width]
            for beam in best:
                beam.text = tok.decode(beam.tokens[n_prompt:], skip_special_tokens=True)
            results.append(BeamSearchOutput(sequences=best))
        return results

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
