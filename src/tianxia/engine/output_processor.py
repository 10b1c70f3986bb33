"""Engine outputs as new tokens, and their text, stop strings and snapshots on the API side.

An engine sends, for each request a step touched, only what is new: the token ids (and logprobs)
each choice gained, and finish reasons (:class:`RequestDelta`, made by :func:`request_delta`
straight from the engine's sequences). Text is the API side's business, as in vLLM V1's
``OutputProcessor``: :class:`OutputProcessor` keeps each request's choices, runs their
incremental detokenizers and stop strings, and hands the server cumulative
:class:`RequestOutput` snapshots (built when read) whose ``stable_len`` says how much of the text
a stream may send. A choice that meets a stop string
finishes here, and the caller tells the engine to stop that choice (``n > 1``: its siblings run
on) or, once all of a request's choices have, the whole request.

The engine runs requests with ``stop`` removed and ``detokenize`` off (:func:`engine_params`), so
an engine core never decodes text. The same code serves an engine on a thread of this process and
engine core processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from transformers import PreTrainedTokenizerBase

from tianxia.engine import faults
from tianxia.engine.detokenizer import IncrementalDetokenizer, fast_decode, rust_tokenizer
from tianxia.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from tianxia.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tianxia.engine.sequence import Sequence


class ChoiceDelta(msgspec.Struct, array_like=True, gc=False):
    """What one choice (sequence) gained in a step."""

    index: int
    new_token_ids: list[int]
    new_logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """What one request gained in a step. The prompt travels with the request's first delta.

    A msgspec struct, encoded as an array: an API process decodes one per request every step, and
    decoding into a struct is several times cheaper than into a dataclass. No cycles (``gc=False``).
    """

    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0


def engine_params(params: SamplingParams) -> SamplingParams:
    """The parameters an engine runs a request with: no stop strings and no text (both are the
    API side's); everything that decides tokens is unchanged."""
    if not params.detokenize and not params.stop_strings:
        return params
    return params.without_text()


def request_delta(request_id: str, seqs: list[Sequence], finished: bool) -> RequestDelta:
    """Engine side: what a request's sequences gained since the last call, from the sequences
    themselves (each remembers how many of its output tokens were sent). A finished choice is in
    every delta of its request from then on (its siblings may run on), so the request's last delta
    names every choice's finish reason."""
    choices = []
    for s in seqs:
        start, total = s.sent_tokens, len(s.token_ids) - s.num_prompt_tokens
        if start == total and s.finish_reason is None:
            continue
        s.sent_tokens = total
        choices.append(ChoiceDelta(
            s.index, s.token_ids[s.num_prompt_tokens + start:],
            None if s.logprobs is None else s.logprobs[start:],
            s.cumulative_logprob, s.finish_reason, s.stop_reason))
    first = seqs[0]
    delta = RequestDelta(request_id, choices, finished, num_cached_tokens=first.num_cached_tokens)
    if not first.prompt_sent:
        first.prompt_sent = True
        delta.prompt, delta.prompt_token_ids = first.prompt, first.prompt_token_ids
        if first.prompt_logprobs is not None:
            delta.prompt_logprobs = list(first.prompt_logprobs)
    return delta


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self, index: int) -> CompletionOutput:
        finished = self.finish_reason is not None
        return CompletionOutput(
            index=index, text=self.detok.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            stable_len=self.detok.stable_len(finished))


@dataclass
class _Request:
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    choices: dict[int, _Choice] = field(default_factory=dict)


class Processed:
    """What :meth:`OutputProcessor.process` made of a delta: whether the engine must stop the
    request (every choice met a stop string here) or some of its choices (not all), and the
    request's cumulative output, built when first read. A stream that falls behind reads only
    the newest of the snapshots queued for it (they are cumulative), so the ones it skips cost
    nothing; read at once (the CLI, a test), it is the output as of this delta."""

    __slots__ = ("_req", "request_id", "finished", "stop_request", "stop_choices", "_output")

    def __init__(self, req: _Request, request_id: str, finished: bool, stop_request: bool,
                 stop_choices: list[int]) -> None:
        self._req, self.request_id, self.finished = req, request_id, finished
        self.stop_request, self.stop_choices = stop_request, stop_choices
        self._output: RequestOutput | None = None

    @property
    def output(self) -> RequestOutput:
        if self._output is None:
            req = self._req
            self._output = RequestOutput(
                request_id=self.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                outputs=[req.choices[i].output(i) for i in sorted(req.choices)],
                finished=self.finished, prompt_logprobs=req.prompt_logprobs,
                num_cached_tokens=req.num_cached_tokens)
        return self._output


class OutputProcessor:
    """API side: one entry per request in flight, fed its :class:`RequestDelta` s."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer)
        self._backend = rust_tokenizer(tokenizer)
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._requests[request_id] = _Request(params)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, delta: RequestDelta) -> Processed | None:
        """The request's snapshot after ``delta``, and what the engine must still be told to
        stop: the request (its choices all finished here, on stop strings, before the engine
        finished it) or single choices that did while their siblings run on.
        None for a request that is no longer tracked (finished here; the engine's last steps).
        A detokenizer that raises propagates; the caller fails that request alone."""
        req = self._requests.get(delta.request_id)
        if req is None:
            return None
        if delta.prompt_token_ids is not None:
            req.prompt, req.prompt_token_ids = delta.prompt, delta.prompt_token_ids
            req.prompt_logprobs = delta.prompt_logprobs
        req.num_cached_tokens = delta.num_cached_tokens
        stopped_here = []
        for d in delta.choices:
            choice = req.choices.get(d.index)
            if choice is None:
                choice = req.choices[d.index] = self._new_choice(req)
            if choice.finish_reason is None:
                self._advance(req, choice, d)
                if choice.finish_reason is not None and d.finish_reason is None:
                    stopped_here.append(d.index)
        all_done = len(req.choices) == req.params.n and all(
            c.finish_reason is not None for c in req.choices.values())
        finished = delta.finished or all_done
        if finished:
            del self._requests[delta.request_id]
        stop_request = finished and not delta.finished
        return Processed(req, delta.request_id, finished, stop_request,
                         [] if finished else stopped_here)

    def _new_choice(self, req: _Request) -> _Choice:
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.stop_strings,
                                       p.include_stop_str_in_output, p.skip_special_tokens,
                                       enabled=p.detokenize, decode=self._decode,
                                       backend=self._backend)
        return _Choice(detok, logprobs=[] if p.logprobs is not None else None)

    @staticmethod
    def _advance(req: _Request, choice: _Choice, d: ChoiceDelta) -> None:
        """Take the choice's new tokens one by one, as the engine produced them; a stop string
        ends it at the token that completed it (tokens after it, in the same step, are dropped)."""
        for i, token in enumerate(d.new_token_ids):
            if faults.ACTIVE and faults.hits("detokenize", req.prompt):
                raise faults.InjectedFault("the detokenizer failed (TIANXIA_FAULT_INJECT)")
            choice.token_ids.append(token)
            if choice.logprobs is not None and d.new_logprobs is not None:
                choice.logprobs.append(d.new_logprobs[i])
            stop = choice.detok.append(token)
            if stop is not None:
                choice.finish_reason, choice.stop_reason = "stop", stop
                if i == len(d.new_token_ids) - 1:
                    choice.cumulative_logprob = d.cumulative_logprob
                elif choice.logprobs is not None:  # tokens after the stop are dropped
                    choice.cumulative_logprob = sum(
                        pos[t].logprob for pos, t in zip(choice.logprobs, choice.token_ids))
                return
        choice.cumulative_logprob = d.cumulative_logprob
        if d.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
            choice.detok.flush()
