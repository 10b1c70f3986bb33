"""The stacked LoRA state a GPU captures in its decode graphs (``layers/lora_stacked.py``), run
here on the host: for the base and three adapters in one batch, its eager steps' per-run products
and a graph's masked products over the static rows both give the deltas of the host's grouped
products, and adapters stay apart as positions are reused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_adapter
from transformers import AutoModelForCausalLM

from tianxia.config import CacheConfig
from tianxia.engine.model_runner import ModelRunner
from tianxia.engine.step_io import TokenRun, prepare_batch
from tianxia.layers.attention import get_backend
from tianxia.layers.lora import LoRAError, LoRAState, load_peft_adapter
from tianxia.layers.lora_stacked import StackedLoRAState
from tianxia.loader import load_model

CPU = torch.device("cpu")
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-stacked")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    return {name: make_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())}


def _setup(tiny_models, adapters, stacked: bool, positions: int = 4):
    loaded = load_model(str(tiny_models["llama"]), dtype=torch.float32, device=CPU, backend=get_backend(CPU),
                        quantization="none")
    model = loaded.model
    targets = model.lora_targets()
    state = (StackedLoRAState(model, targets, positions=positions, max_rank=8, max_rows=64, dtype=torch.float32,
                              device=CPU) if stacked else LoRAState(model, targets))
    for slot, (name, path) in enumerate(adapters.items()):
        state.put(10 + slot, load_peft_adapter(name, path, targets, 8))
    runner = ModelRunner(model, loaded.config, CacheConfig(block_size=16, num_blocks=16), CPU, torch.float32)
    runner.lora = state
    return model, runner, state


def _batch(runner, slots: list[int]):
    """One prompt of 6 tokens per slot (-1: the base), all in one step."""
    runs = [(TokenRun([100 + 7 * i + t for t in range(6)], 0, [i], lora_slot=s), 6) for i, s in enumerate(slots)]
    step = prepare_batch(runs, 16)[1]
    return step, *runner.tensors(step)


def _forward(model, runner, state, slots: list[int], static: bool = False) -> torch.Tensor:
    step, ids, pos, meta = _batch(runner, slots)
    rows = runner.lora_rows(step) or [-1] * ids.shape[0]
    with torch.inference_mode():
        if static:
            # as a replayed graph: no per-step rows, the static buffer holds each row's position
            positions = [state.position_of.get(s, -1) for s in rows]
            state.static_rows[: len(rows)] = torch.tensor(positions)
            hidden = model(ids, pos, runner.kv_caches, meta)
        else:
            state.begin_step(rows, None)
            try:
                hidden = model(ids, pos, runner.kv_caches, meta)
            finally:
                state.end_step()
        return model.compute_logits(hidden)


def test_stacked_deltas_equal_the_grouped_products(tiny_models, adapters):
    slots = [-1, -1, 10, 11, 11, 12]  # in the order a step puts them (by adapter)
    model, runner, state = _setup(tiny_models, adapters, stacked=True, positions=4)
    got = _forward(model, runner, state, slots)
    ref_model, ref_runner, ref_state = _setup(tiny_models, adapters, stacked=False)
    want = _forward(ref_model, ref_runner, ref_state, slots)
    base = _forward(ref_model, ref_runner, ref_state, [-1] * len(slots))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the adapters move the logits (else equality would prove nothing), the base rows not at all
    per_seq = got.view(len(slots), 6, -1)
    moved = (per_seq - base.view(len(slots), 6, -1)).abs().amax(dim=(1, 2))
    assert all(moved[i] > 1e-2 for i, s in enumerate(slots) if s >= 0)
    assert all(moved[i] < 1e-5 for i, s in enumerate(slots) if s < 0)
    # a CUDA graph's replay reads the rows from the static buffer instead, and multiplies every
    # row by every position's columns under the mask: the same deltas
    static = _forward(model, runner, state, slots, static=True)
    torch.testing.assert_close(static, want, atol=1e-4, rtol=1e-4)


def test_positions_are_reused_and_cleared(tiny_models, adapters):
    model, runner, state = _setup(tiny_models, adapters, stacked=True, positions=3)
    targets = model.lora_targets()
    alone = _forward(model, runner, state, [12])
    # every position holds an adapter: a fourth is refused with the reason
    with pytest.raises(LoRAError, match="GPU adapter positions are in use"):
        state.put(20, load_peft_adapter("again", adapters["qv"], targets, 8))
    # dropping one frees its position, and its columns are zero: the next adapter there is
    # exactly itself (no leftover of the dropped one)
    dropped = state.position_of[10]
    state.drop(10)
    state.put(20, load_peft_adapter("mlp2", adapters["mlp"], targets, 8))
    assert state.position_of[20] == dropped
    torch.testing.assert_close(_forward(model, runner, state, [20]), alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_forward(model, runner, state, [20], static=True), alone, atol=1e-4, rtol=1e-4)


def test_an_adapter_wider_than_its_columns_is_refused(tiny_models, adapters):
    loaded = load_model(str(tiny_models["llama"]), dtype=torch.float32, device=CPU, backend=get_backend(CPU),
                        quantization="none")
    targets = loaded.model.lora_targets()
    state = StackedLoRAState(loaded.model, targets, positions=2, max_rank=4, max_rows=4, dtype=torch.float32,
                             device=CPU)
    with pytest.raises(LoRAError, match="--max-lora-rank 4"):
        state.put(0, load_peft_adapter("all", adapters["all"], targets, 8))
    assert state.position_of == {}
