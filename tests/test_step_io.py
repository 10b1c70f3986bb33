"""The step seam: the scheduler's plain-data StepInput, the runner's RunnerOutput, and
``Scheduler.update`` applying it, driven by hand on the real SmolLM2 engine against transformers."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from tianxia.engine.sequence import Sequence
from tianxia.engine.step_io import StepInput
from tianxia.sampling_params import SamplingParams

PROMPT = "The three primary colors are"


def _values(obj):
    """Everything reachable from a step input's fields."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _values(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _values(x)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _values(k)
            yield from _values(v)
    else:
        yield obj


def _reference_logprobs(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1].float().log_softmax(-1)


def _schedule(engine):
    out = engine.scheduler.schedule()
    assert out.scheduled and not out.rejected
    out.forks = engine._fork(out.scheduled)
    return out


def test_a_step_crosses_as_plain_data_and_update_applies_it(smollm2_llm, smollm2_reference):
    engine = smollm2_llm.engine
    assert not engine.has_unfinished_requests()
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("plain-step", PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=3))
    out = _schedule(engine)
    step = engine.scheduler.step_input(out)
    assert isinstance(step, StepInput) and step.num_seqs == 1
    assert not any(isinstance(v, Sequence) for v in _values(step))
    # what another process would get: the runner needs nothing but this copy
    result = engine.runner.execute(pickle.loads(pickle.dumps(step)))
    assert isinstance(result.sampled_token_ids, torch.Tensor)
    (seq,) = engine.requests["plain-step"]
    ref = _reference_logprobs(smollm2_reference, seq.token_ids)
    token = result.tokens()[seq.seq_id]
    assert token == int(ref.argmax())
    top_ids, top_lps, chosen_lp, rank = result.logprobs[seq.seq_id]
    assert top_ids == ref.topk(3).indices.tolist() and rank == 1
    assert max(abs(a - b) for a, b in zip(top_lps, ref.topk(3).values.tolist())) < 1e-4

    # the scheduler's update appends the token and counts the prompt computed; nothing ends yet
    assert seq.num_output_tokens == 0
    assert engine.scheduler.update(out, result, engine) == ["plain-step"]
    assert seq.output_token_ids == [token] and seq.num_computed_tokens == seq.num_prompt_tokens
    assert seq in engine.scheduler.running and seq.finish_reason is None
    assert set(seq.logprobs[0]) >= set(top_ids)

    # the second token reaches max_tokens: update ends the sequence and frees its blocks
    outputs = engine.step()
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "length"
    assert seq.output_token_ids[1] == int(_reference_logprobs(smollm2_reference, seq.token_ids[:-1]).argmax())
    assert not engine.scheduler.running and engine.block_manager.num_free_blocks == free_before


def test_update_stops_at_a_stop_token_and_frees_its_blocks(smollm2_llm, smollm2_reference):
    engine = smollm2_llm.engine
    free_before = engine.block_manager.num_free_blocks
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    first = int(_reference_logprobs(smollm2_reference, ids).argmax())
    # n = 2: the sibling forked when the prompt is done samples from the same row, and stops too
    engine.add_request("stop-token", PROMPT, SamplingParams(temperature=0, max_tokens=8, n=2,
                                                             stop_token_ids=[first]))
    out = _schedule(engine)
    step = engine.scheduler.step_input(out)
    assert step.num_seqs == 1 and len(step.sample_rows) == 2 and len(set(step.sample_rows)) == 1
    result = engine.runner.execute(step)
    assert engine.scheduler.update(out, result, engine) == ["stop-token"]
    seqs = engine.requests["stop-token"]
    assert len(seqs) == 2
    for seq in seqs:
        assert seq.output_token_ids == [first]
        assert (seq.finish_reason, seq.stop_reason) == ("stop", first) and seq.is_finished
    assert not engine.scheduler.running and engine.block_manager.num_free_blocks == free_before
    assert engine._output("stop-token").finished
