"""``Runtime``: the engine in this process, shared by every program and thread.

One :class:`~tianxia.engine.async_engine.AsyncLLMEngine` owns the engine and steps it on its own
thread; program threads hand it requests through an asyncio loop running on another thread, so
the calls of concurrent programs (``run_batch``, forks) are batched into the same engine steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

from tianxia.lang.backend.tokens import TokenStateBackend
from tianxia.lang.chat_template import ChatTemplate, JinjaChatTemplate, get_chat_template
from tianxia.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from tianxia.lang.ir import SglSamplingParams

logger = logging.getLogger(__name__)
_runtime_ids = itertools.count()


def engine_sampling_params(sp: SglSamplingParams):
    """The engine's ``SamplingParams`` for a gen (regex / json_schema go to ``structured_outputs``)."""
    import dataclasses

    from tianxia.sampling_params import SamplingParams

    kw: dict[str, Any] = {
        "max_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k and sp.top_k > 0 else 0,
        "min_p": sp.min_p,
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "ignore_eos": bool(sp.ignore_eos),
        "stop": sp.stop_list or None,
        "stop_token_ids": list(sp.stop_token_ids or []) or None,
        "min_tokens": sp.min_new_tokens or 0,
    }
    if sp.return_logprob:
        kw["logprobs"] = sp.top_logprobs_num or 0
    if sp.regex is not None or sp.json_schema is not None:
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        if "structured_outputs" not in fields:
            raise NotImplementedError(
                "gen(regex=...) and gen(json_schema=...) need the engine's structured output "
                "support (SamplingParams.structured_outputs), which this build lacks"
            )
        if sp.regex is not None and sp.json_schema is not None:
            raise ValueError("gen takes regex or json_schema, not both")
        kw["structured_outputs"] = (
            {"regex": sp.regex} if sp.regex is not None else {"json": sp.json_schema}
        )
    return SamplingParams(**kw)


def finish_info(out) -> dict[str, Any]:
    c = out.outputs[0]
    info: dict[str, Any] = {"type": c.finish_reason}
    if c.stop_reason is not None:
        info["matched"] = c.stop_reason
    return info


class Runtime(TokenStateBackend):
    """``Runtime(model_path="smollm2-135m", **engine_args)``: ``engine_args`` are ``LLM``'s
    (``kv_cache_memory``, ``max_model_len``, ``enable_prefix_caching``, ``max_num_seqs``, ...).

    ``chat_template``: the model's own (default), a Jinja template text, or ``"chatml"`` /
    ``"default"``. ``gil_switch_interval``: the engine steps on a thread of this process, next to
    the programs' threads; Python's switch interval is lowered to this (process-wide; ``None``
    leaves it) so that the engine thread does not wait up to 5 ms for the GIL at each handoff.
    Call :meth:`shutdown` when done (it also runs at interpreter exit).
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model: str | None = None,
        chat_template: str | ChatTemplate | None = None,
        log_level: str | None = None,
        gil_switch_interval: float | None = 0.0002,
        **engine_args: Any,
    ) -> None:
        super().__init__()
        if gil_switch_interval is not None and sys.getswitchinterval() > gil_switch_interval:
            # the engine thread shares the GIL with every program thread: with Python's default
            # 5 ms switch interval it can wait that long for the GIL between kernel launches
            sys.setswitchinterval(gil_switch_interval)
        from tianxia.engine.async_engine import AsyncLLMEngine, build_off_main_thread
        from tianxia.llm import LLM

        spec = model_path or model or "smollm2-135m"
        jinja = isinstance(chat_template, str) and ("{%" in chat_template or "{{" in chat_template)
        template = chat_template if jinja else None
        self.llm = build_off_main_thread(lambda: LLM(spec, chat_template=template, **engine_args))
        self.engine = self.llm.engine
        self.tokenizer = self.engine.tokenizer
        self.model_path = spec
        self.block_size = self.engine.config.cache.block_size
        self.bos_token = self.tokenizer.bos_token
        self.bos_token_id = self.tokenizer.bos_token_id
        if chat_template is not None and not jinja:
            self.chat_template = get_chat_template(chat_template)
        elif self.engine.chat_template:
            self.chat_template = JinjaChatTemplate(self._render_chat, name="model")
        else:
            self.chat_template = get_chat_template(None)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="tianxia-lang-loop", daemon=True
        )
        self._loop_thread.start()
        self.async_engine = AsyncLLMEngine(self.engine, log_stats_interval=None)
        self.async_engine.start(self._loop)
        self._prefix = f"lang{next(_runtime_ids)}-"
        self._ids = itertools.count()
        self._closed = False
        import atexit

        atexit.register(self.shutdown)

    # --- plumbing -----------------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _render_chat(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.engine.chat_template, tokenize=False,
            add_generation_prompt=False,
        )

    def _rid(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    def _run(self, coro):
        if self._closed:
            coro.close()
            raise RuntimeError("this Runtime has been shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _final(self, prompt: Any, params) -> Any:
        last = None
        async for out in self.async_engine.generate(prompt, params, self._rid()):
            last = out
        return last

    async def _many(self, requests: list[tuple[Any, Any]]) -> list[Any]:
        return list(await asyncio.gather(*(self._final(p, sp) for p, sp in requests)))

    def _prefill(self, ids: list[int]) -> None:
        from tianxia.sampling_params import SamplingParams

        self._run(self._final({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0)))

    def _meta(self, out, prompt_ids: list[int], sp: SglSamplingParams | None = None) -> dict[str, Any]:
        c = out.outputs[0]
        meta: dict[str, Any] = {
            "id": out.request_id,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "finish_reason": finish_info(out),
        }
        if sp is not None and sp.return_logprob and c.logprobs is not None:
            decode = self.tokenizer.decode
            meta["output_token_logprobs"] = [
                (pos[t].logprob, t, decode([t]) if sp.return_text_in_logprobs else None)
                for t, pos in zip(c.token_ids, c.logprobs)
            ]
        return meta

    # --- the backend API ----------------------------------------------------------------------

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        return self.model_path

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, s, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        ids, _ = self.prompt_ids(s)
        text = s.text_
        out = self._run(self._final({"prompt_token_ids": ids}, engine_sampling_params(sampling_params)))
        comp = out.outputs[0].text
        self.remember_output(s, text, ids, out.outputs[0].token_ids, comp)
        return comp, self._meta(out, ids, sampling_params)

    def generate_stream(self, s, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        ids, _ = self.prompt_ids(s)
        text = s.text_
        params = engine_sampling_params(sampling_params)
        hold = max((len(x) for x in sampling_params.stop_list), default=1) - 1
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.async_engine.generate({"prompt_token_ids": ids}, params, self._rid()):
                    q.put(("out", out))
                q.put(("done", None))
            except BaseException as e:  # noqa: BLE001 - re-raised on the program's thread
                q.put(("error", e))

        asyncio.run_coroutine_threadsafe(pump(), self._loop)
        sent, last = 0, None
        while True:
            kind, item = q.get()
            if kind == "error":
                raise item
            if kind == "done":
                break
            last = item
            t = item.outputs[0].text
            end = len(t) if item.finished else max(sent, len(t) - hold)
            if end > sent:
                yield t[sent:end], self._meta(item, ids, sampling_params)
                sent = end
        if last is None:
            return
        self.remember_output(s, text, ids, last.outputs[0].token_ids, last.outputs[0].text[:sent])

    def select(
        self, s, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        """Score every ``prefix + choice`` in one batch of requests. Each asks for the prompt
        logprobs from the first choice token on (``prompt_logprobs_start``), so the prefix's
        full KV blocks come from the prefix cache; a prefix with uncached full blocks is
        prefilled once first, so that the choices share it instead of each computing it."""
        from tianxia.sampling_params import SamplingParams

        if temperature > 1e-5:
            raise ValueError("select scores choices greedily; temperature must be 0")
        prefix, known = self.prompt_ids(s)
        text = s.text_
        with self._tok_lock:
            choice_ids = [self._encode(c, False) for c in choices]
        n = len(prefix)
        if len(choices) > 1 and (n - known) // self.block_size >= 1:
            self._prefill(prefix)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        requests: list[tuple[Any, Any]] = [
            ({"prompt_token_ids": prefix + c, "prompt_logprobs_start": n}, params) for c in choice_ids
        ]
        if choices_method.requires_unconditional_logprobs:
            requests += [({"prompt_token_ids": c}, params) for c in choice_ids]
        outs = self._run(self._many(requests))
        decode = self.tokenizer.decode
        input_token_logprobs = []
        for c, out in zip(choice_ids, outs):
            plp = out.prompt_logprobs
            input_token_logprobs.append(
                [(plp[n + j][t].logprob, t, decode([t])) for j, t in enumerate(c)]
            )
        normalized = [sum(x[0] for x in row) / len(row) for row in input_token_logprobs]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = []
            for c, out in zip(choice_ids, outs[len(choices) :]):
                plp = out.prompt_logprobs
                unconditional.append(
                    [(plp[j][t].logprob if plp[j] else None, t, decode([t])) for j, t in enumerate(c)]
                )
        decision = choices_method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_token_logprobs,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional,
        )
        best = choices.index(decision.decision)
        decision.meta_info = dict(decision.meta_info or {})
        decision.meta_info["cached_tokens"] = [o.num_cached_tokens for o in outs[: len(choices)]]
        self.remember_output(s, text, prefix, choice_ids[best], decision.decision)
        return decision

    def commit_lazy_operations(self, s) -> None:
        ids, known = self.prompt_ids(s)
        if (len(ids) - known) // self.block_size >= 1:
            self._prefill(ids)
            self.remember(s, s.text_, ids)

    def cache_prefix(self, prefix_str: str) -> None:
        self._prefill(self.encode_text(prefix_str, first=True))

    def generate_requests(self, prompts: list[Any], params) -> list[Any]:
        """Raw engine requests (token-id lists or prompt dicts, one ``SamplingParams`` or one per
        prompt) through this runtime's shared engine, batched together; the final
        ``RequestOutput`` of each, in order."""
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompts)
        prompts = [
            {"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts
        ]
        return self._run(self._many(list(zip(prompts, params))))

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """The engine's counters (``prefix_cache_hits``, ``prompt_tokens``, ...), read between steps."""
        return self._run(self.async_engine.call(lambda e: e.stats()))

    def flush_cache(self) -> bool:
        """Forget every cached prefix (only while no request runs)."""

        def flush(engine) -> bool:
            reset = getattr(engine, "reset_prefix_cache", None)
            if reset is not None:
                return bool(reset())
            if engine.has_unfinished_requests():
                return False
            bm = engine.block_manager
            for block in bm.blocks:
                if block.ref_count == 0:
                    block.key = None
            bm.cached.clear()
            return True

        return self._run(self.async_engine.call(flush))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.async_engine.shutdown(), self._loop).result(30)
        except Exception:
            logger.debug("engine shutdown failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)
