"""LoRA adapters, offline: adapters built with ``peft`` on tiny random models of two families and
on SmolLM2, saved, and served by tianxia; greedy tokens and logprobs must equal
``transformers`` + ``peft`` in float32, with the base and three adapters mixed in one batch of 16.
Also: the prefix cache never serves one adapter's blocks to another, and bad adapters are clear
errors that leave the engine serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_match, make_adapter, reference
from transformers import AutoModelForCausalLM

from tianxia import LLM, SamplingParams
from tianxia.engine.lora_manager import LoRARequest
from tianxia.layers.lora import LoRAError

NEW_TOKENS = 8
PROMPTS = [
    "The quick brown fox", "def add(a, b):", "Once upon a time", "The capital of France is",
]
# name -> LoraConfig keywords: attention only, every projection, MLP only, rsLoRA of rank 4
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
}


def generate_mixed(llm: LLM, adapters: dict[str, Path], prompts: list[str]) -> tuple[list, list]:
    """The base and every adapter, each on every prompt, in one batch: the (adapter name, prompt)
    jobs and their outputs."""
    tok = llm.get_tokenizer()
    jobs = [(name, p) for name in (None, *adapters) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True)
    loras = [None if name is None else LoRARequest(name, i + 1, str(adapters[name]))
             for i, (name, _) in enumerate(jobs)]
    outs = llm.generate([{"prompt_token_ids": tok.encode(p)} for _, p in jobs], params, use_tqdm=False,
                        lora_request=loras)
    return jobs, outs


def check_against_peft(llm: LLM, base, adapters: dict[str, Path], prompts: list[str], label: str,
                       fused_decode: bool = True) -> list:
    """The base and every adapter, each on every prompt, in one batch: tianxia vs peft; returns
    the outputs."""
    jobs, outs = generate_mixed(llm, adapters, prompts)
    # prompts take the module forward; decode steps, adapters in them or not, the fused step
    # (unless ``fused_decode`` is off: tensor-parallel ranks run the module forward throughout)
    assert llm.engine.runner.route_counts["eager"] > 0
    assert (llm.engine.runner.route_counts["fused"] > 0) == fused_decode
    first_step: dict[tuple[str | None, str], torch.Tensor] = {}
    for (name, prompt), out in zip(jobs, outs):
        got = out.outputs[0].token_ids
        ref_tokens, ref_lps = reference(base, adapters.get(name), out.prompt_token_ids, got)
        print(assert_greedy_match(ref_tokens, got, lambda i: ref_lps[i], f"{label}/{name}"))
        for i, (token, entry) in enumerate(zip(got, out.outputs[0].logprobs)):
            if got[: i + 1] != ref_tokens[: i + 1]:
                break
            assert abs(entry[token].logprob - ref_lps[i][token].item()) < 1e-4, (label, name, i)
        first_step[name, prompt] = ref_lps[0]
    # the adapters really move the logprobs (else the test would prove nothing): by 100x the 1e-4
    # the logprobs are held to (a random adapter's shift on one prompt can be under 0.05)
    for name, prompt in jobs:
        if name is not None:
            assert (first_step[name, prompt] - first_step[None, prompt]).abs().max() > 0.01, name
    return outs


@pytest.fixture(scope="module")
def tiny_adapters(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    out = {}
    for arch in ("llama", "qwen2"):
        root = tmp_path_factory.mktemp(f"lora-{arch}")
        base = AutoModelForCausalLM.from_pretrained(str(tiny_models[arch]), dtype=torch.float32)
        out[arch] = (tiny_models[arch], {
            name: make_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())
        })
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_adapters):
    return LLM(str(tiny_adapters["llama"][0]), kv_cache_memory="64MiB", max_model_len=256, seed=0,
               cpu_activations="float32", enable_lora=True, max_loras=3, max_lora_rank=8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_base_and_three_adapters_in_one_batch_match_peft(arch, tiny_adapters):
    model_dir, adapters = tiny_adapters[arch]
    llm = LLM(str(model_dir), kv_cache_memory="64MiB", max_model_len=256, seed=0, cpu_activations="float32",
              enable_lora=True, max_loras=3, max_lora_rank=8)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    check_against_peft(llm, base, adapters, PROMPTS, arch)


def float16_values(adapter: Path) -> Path:
    """The PEFT adapter with its matrices rounded to float16 values (kept float32 in the file):
    over a packed model tianxia holds adapters in float16 (layers/lora.py ``adapter_dtype``), which
    loses nothing on these (their scalings, 1 and 2, are powers of two), so the comparison with
    peft stays at float32 rounding."""
    from safetensors.torch import load_file, save_file

    file = adapter / "adapter_model.safetensors"
    save_file({k: t.half().float() for k, t in load_file(str(file)).items()}, str(file))
    return adapter


def test_smollm2_adapters_match_peft(smollm2_path, smollm2_reference, tmp_path):
    # SmolLM2's GGUF weights are packed: its adapters are held in float16
    adapters = {
        "all": float16_values(make_adapter(smollm2_reference, tmp_path / "all", 0, **ADAPTERS["all"])),
        "qv": float16_values(make_adapter(smollm2_reference, tmp_path / "qv", 1, **ADAPTERS["qv"])),
    }
    llm = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_model_len=256, seed=0, cpu_activations="float32",
              enable_lora=True, max_loras=2, max_lora_rank=8)
    check_against_peft(llm, smollm2_reference, adapters, PROMPTS[:2], "smollm2")


def test_fused_decode_step_adds_the_same_deltas_as_the_module_path(tiny_llm, tiny_adapters):
    """The fused C++ step and the module forward's hooks give the same bits with adapters."""
    adapters = tiny_adapters["llama"][1]
    runner = tiny_llm.engine.runner
    assert runner.fused_lora
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)
    loras = [None, *(LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items()))]
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS)]

    routes_agree(tiny_llm, prompts, params, loras)


def test_packed_model_holds_float16_adapters_and_both_routes_agree(smollm2_path, smollm2_reference, tmp_path):
    """Over a packed (GGUF) model the adapters are held in float16 (half the bytes a decode step
    reads): the fused decode step and the module path still give the same tokens and logprobs bit
    for bit, and each delta is the float32 adapter's within float16 rounding."""
    adapters = {
        "all": make_adapter(smollm2_reference, tmp_path / "all", 0, **ADAPTERS["all"]),
        "qv": make_adapter(smollm2_reference, tmp_path / "qv", 1, **ADAPTERS["qv"]),
    }
    # the default 8-bit activations, as served
    llm = LLM(str(smollm2_path), kv_cache_memory="64MiB", max_model_len=256, seed=0, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    runner = llm.engine.runner
    assert runner.fused_lora
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)
    loras = [None, *(LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())),
             LoRARequest("all", 1, str(adapters["all"]))]
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS)]

    fused = routes_agree(llm, prompts, params, loras)
    assert fused[1] != fused[0] and fused[2] != fused[0]  # the adapters change the outputs

    manager = llm.engine.lora_manager
    state = runner.lora
    g = torch.Generator().manual_seed(0)
    torch.set_grad_enabled(False)  # dense_linear takes the kernels outside autograd only
    try:
        _check_float16_deltas(adapters, manager, state, g)
    finally:
        torch.set_grad_enabled(True)


def _check_float16_deltas(adapters: dict[str, Path], manager, state, g: torch.Generator) -> None:
    from tianxia.layers.lora import load_peft_adapter
    from tianxia.quant.cpu_kernels import dense_linear

    for name, path in adapters.items():
        held = state.slots[manager.slot_of[name]]
        f32 = load_peft_adapter(name, path, state.targets, max_rank=8)
        assert held.nbytes * 2 == f32.nbytes
        for module, parts in f32.weights.items():
            for p32, p16 in zip(parts, held.weights[module], strict=True):
                assert p16.a.dtype == p16.b.dtype == torch.float16 and p16.row0 == p32.row0
                x = torch.randn(5, p32.a.shape[1], generator=g)
                got = dense_linear(dense_linear(x, p16.a), p16.b)
                # the float32 products of the float16 values, bit for bit
                assert torch.equal(got, dense_linear(dense_linear(x, p16.a.float()), p16.b.float()))
                want = (x.double() @ p32.a.double().T) @ p32.b.double().T
                # each of A's and B's values rounded once to float16 (relative 2^-11), then float32
                bound = (x.double().abs() @ p32.a.double().abs().T) @ p32.b.double().abs().T
                assert bool(((got.double() - want).abs() <= 2.2 * 2**-11 * bound + 1e-6).all()), (name, module)
                assert not torch.equal(got, dense_linear(dense_linear(x, p32.a), p32.b))  # really float16


def test_prefix_cache_keys_blocks_by_adapter(tiny_llm, tiny_adapters):
    adapters = tiny_adapters["llama"][1]
    prompt = "The history of the printing press begins " * 8  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    qv = LoRARequest("qv", 1, str(adapters["qv"]))
    everything = LoRARequest("all", 2, str(adapters["all"]))

    def run(lora):
        return tiny_llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]

    first = run(qv)
    again = run(qv)
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # the same tokens under another adapter, or the base, are other K/V: no hit from qv's blocks
    other, base = run(everything), run(None)
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # and each is what it gets alone in a fresh engine
    fresh = LLM(str(tiny_adapters["llama"][0]), kv_cache_memory="64MiB", max_model_len=256,
                cpu_activations="float32", enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
    for out, lora in ((other, everything), (base, None), (first, qv)):
        alone = fresh.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_max_cpu_loras_reloads_evicted_adapters(tiny_adapters):
    model_dir, adapters = tiny_adapters["llama"]
    llm = LLM(str(model_dir), kv_cache_memory="64MiB", max_model_len=256, cpu_activations="float32",
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    first = [llm.generate("Once upon a time", params, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for r in requests]
    assert len(llm.engine.lora_manager._resident) == 1
    # one resident adapter at a time, one adapter per batch (--max-loras 1): a mixed batch still
    # completes, each request with its own adapter's tokens
    state = llm.engine.lora_manager.state
    per_step: list[set[int]] = []
    begin = state.begin_step
    state.begin_step = lambda rows, keep: (per_step.append({s for s in rows if s >= 0}), begin(rows, keep))[1]
    try:
        outs = llm.generate(["Once upon a time"] * 3, params, use_tqdm=False, lora_request=requests)
    finally:
        del state.begin_step
    assert [o.outputs[0].token_ids for o in outs] == first
    assert per_step and all(len(slots) == 1 for slots in per_step)


def _corrupt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes()[:100])
    return dst


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(tiny_llm, tiny_adapters, tmp_path):
    llama_dir, adapters = tiny_adapters["llama"]
    big = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    high_rank = make_adapter(big, tmp_path / "r32", 0, r=32, lora_alpha=32, target_modules=["q_proj"])
    head = make_adapter(big, tmp_path / "head", 0, r=4, target_modules=["lm_head"])
    saved = make_adapter(big, tmp_path / "saved", 0, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    other = tmp_path / "other-base"  # a llama of another width: same names, other shapes
    from helpers import make_tiny_hf_model

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            (tok_dir / f.name).write_bytes(f.read_bytes())
    make_tiny_hf_model("llama", other, tok_dir, hidden_size=32)
    wide = make_adapter(AutoModelForCausalLM.from_pretrained(str(other)), tmp_path / "wide", 0, r=4,
                        target_modules=["q_proj"])
    corrupt = _corrupt(adapters["qv"], tmp_path / "corrupt")
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{not json")
    cases = {
        high_rank: "above --max-lora-rank 8",
        head: "no module 'lm_head'",
        saved: "modules_to_save",
        wide: "another base model",
        corrupt: "unreadable safetensors",
        bad_json: "unreadable adapter config",
        tmp_path / "missing": "not a PEFT adapter directory",
    }
    for i, (path, words) in enumerate(cases.items()):
        with pytest.raises(LoRAError, match=words.replace("(", r"\(")) as err:
            tiny_llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False,
                              lora_request=LoRARequest(f"bad{i}", 100 + i, str(path)))
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        tiny_llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False, lora_request=LoRARequest("nope", 9))
    # nothing of the failures stayed registered, and the engine still serves base and adapters
    assert not any(n.startswith("bad") for n in tiny_llm.engine.list_loras())
    outs = tiny_llm.generate(["Hi", "Hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                             lora_request=[None, LoRARequest("qv", 1, str(adapters["qv"]))])
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_lora_needs_enable_lora(smollm2_llm, tiny_adapters):
    with pytest.raises(ValueError, match="enable_lora=True"):
        smollm2_llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False,
                             lora_request=LoRARequest("qv", 1, str(tiny_adapters["llama"][1]["qv"])))


def _peft_two_adapters(base, first: Path, second: Path, second_scale: float):
    """peft with both adapters active (their deltas summed), the second's scaling times a factor."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(base, str(first), adapter_name="first")
    model.load_adapter(str(second), adapter_name="second")
    model.base_model.set_adapter(["first", "second"])
    for module in model.modules():
        if isinstance(module, LoraLayer) and "second" in module.scaling:
            module.scaling["second"] *= second_scale
    return model


def test_cli_run_with_lora_and_lora_scaled_matches_peft(tiny_adapters):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    model_dir, adapters = tiny_adapters["llama"]
    prompt = "Once upon a time"
    cmd = [sys.executable, "-m", "tianxia.cli", "run", "-m", str(model_dir), "-p", prompt, "-n", "6", "--temp", "0",
           "--cpu-activations", "float32", "--kv-cache-memory", "32MiB", "-c", "128",
           "--lora", str(adapters["qv"]), "--lora-scaled", str(adapters["all"]), "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = _peft_two_adapters(base, adapters["qv"], adapters["all"], 0.5)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert proc.stdout == prompt + tokenizer.decode(out[0, len(ids):])
    bad = subprocess.run(cmd[:-5] + ["--lora", str(model_dir / "nowhere")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "not a PEFT adapter directory" in bad.stderr


def write_gguf_lora(peft_dir: Path, out: Path, heads: int, kv_heads: int) -> Path:
    """llama.cpp's GGUF adapter of a PEFT adapter, as ``convert_lora_to_gguf.py`` writes it for
    a ``llama`` base (q/k rows of B permuted like the base's q/k weights)."""
    import json
    import re

    import gguf
    from safetensors.torch import load_file

    from tianxia.loader.gguf import hf_to_gguf_name

    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        module, ab = re.match(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key).groups()
        if ab == "B" and module.endswith(("q_proj", "k_proj")):
            n = heads if module.endswith("q_proj") else kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        writer.add_tensor(hf_to_gguf_name(module + ".weight") + (".lora_a" if ab == "A" else ".lora_b"),
                          t.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_gguf_lora_adapter_matches_peft(tiny_llm, tiny_adapters, smollm2_path, tmp_path):
    model_dir, adapters = tiny_adapters["llama"]
    config = tiny_llm.engine.model_config
    path = write_gguf_lora(adapters["all"], tmp_path / "all.gguf", config.num_attention_heads,
                           config.num_key_value_heads)
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        out = tiny_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False,
                                lora_request=LoRARequest("gguf-all", 50, str(path)))[0].outputs[0]
        ref_tokens, ref_lps = reference(base, adapters["all"], ids, out.token_ids)
        assert out.token_ids == ref_tokens
        for i, (t, entry) in enumerate(zip(ref_tokens, out.logprobs)):
            assert abs(entry[t].logprob - ref_lps[i][t].item()) < 1e-4
    with pytest.raises(LoRAError, match="not a GGUF LoRA adapter"):
        tiny_llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False,
                          lora_request=LoRARequest("model-file", 51, str(smollm2_path)))


def test_lora_modules_flag_forms():
    from tianxia.config import parse_lora_modules

    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}']) == [
        ("a", "/x/a"), ("b", "/x/b")]
    for bad in ("no-equals", "=path", '{"name": "b"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def routes_agree(llm: LLM, prompts: list[str], params: SamplingParams, loras: list) -> list:
    """Generate through the fused decode step, then through the module forward's hooks; the two
    must give the same tokens and logprobs. Returns the outputs."""
    runner = llm.engine.runner

    def run() -> list:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
                for o in outs]

    fused_before = runner.route_counts["fused"]
    fused = run()
    assert runner.route_counts["fused"] >= fused_before + NEW_TOKENS - 1
    runner.fused_lora = False
    try:
        assert run() == fused
    finally:
        runner.fused_lora = True
    return fused
