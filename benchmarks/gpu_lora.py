"""LoRA adapters on one GPU: the 256-sequence workload of ``gpu_fast_path.py`` (input and output
lengths uniform in [100, 1024], greedy, EOS ignored) on a random-weight model of the Qwen2.5-0.5B
shape, saved as a Hugging Face directory and loaded through tianxia's loader, with random PEFT
adapters of rank 16 on every projection (q, k, v, o, gate, up, down):

- ``base``: the engine without ``--enable-lora``;
- ``base, LoRA on``: the LoRA engine, every request on the base model;
- ``1 adapter``: every request on one adapter;
- ``4 adapters``: the requests spread over 4 adapters (the batch mixes them).

Output tokens/s of each, and the ratio to ``base``; batch-1 decode ms/token of the base engine,
of the LoRA engine on the base, and with an adapter. Both engines stay loaded and the cases
alternate for ``--rounds`` rounds (medians).

    PYTHONPATH=src python benchmarks/gpu_lora.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_fast_path as fp  # noqa: E402  (the throughput workload's loop)


def make_adapters(model_dir: Path, root: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        peft = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=2 * rank, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        paths.append(root / f"adapter{i}")
        peft.save_pretrained(str(paths[-1]))
        peft.unload()
    return paths


def run(llm, prompts, outs, loras) -> float:
    """Seconds for the workload, greedy, request ``i`` on ``loras[i % len(loras)]``."""
    return fp.run_workload(llm.engine, prompts, outs, {"temperature": 0.0}, loras)


def batch1_ms(llm, prompt, lora, n: int = 128) -> float:
    steps = []
    from tianxia import SamplingParams

    engine = llm.engine
    engine.add_request(f"b1-{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, temperature=0.0),
                       lora_request=lora)
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return sum(steps[1:]) / len(steps[1:]) * 1e3


def logprob_error(llm, model_dir: Path, adapter: Path | None, lora, prompts: list[list[int]], n: int = 16) -> dict:
    """Our greedy tokens' logprobs (through the decode graphs) against transformers (+ peft)
    teacher-forced on the same tokens, bf16: max and mean absolute difference."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tianxia import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0),
                        use_tqdm=False, lora_request=lora)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    if adapter is not None:
        ref = PeftModel.from_pretrained(ref, str(adapter))
    diffs = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            toks = list(o.outputs[0].token_ids)
            ids = torch.tensor([p + toks], device="cuda")
            lp = ref(ids).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
            for i, t in enumerate(toks):
                diffs.append(abs(lp[i, t].item() - o.outputs[0].logprobs[i][t].logprob))
    del ref
    torch.cuda.empty_cache()
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)}


def main() -> int:
    from gpu_build_startup import make_model_dir

    from tianxia import LLM
    from tianxia.engine.lora_manager import LoRARequest

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tx-lora-"))
    d = make_model_dir(root, args.shape)
    adapters = make_adapters(d, root, 4, args.rank)
    rng = random.Random(3)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(args.num_seqs)]
    prompts = [[rng.randrange(1, 150000) for _ in range(i)] for i, _ in lens]
    outs = [o for _, o in lens]
    # no prefix cache: each case computes every prompt (the warm-up's prompts would be cached for
    # the base or the adapters they ran with, and the cases would differ in prefill work)
    common = dict(device="cuda", dtype="bfloat16", max_num_seqs=args.num_seqs, max_model_len=2048,
                  max_num_batched_tokens=8192, enable_prefix_caching=False)
    res: dict = {}
    # both engines stay loaded and the cases alternate, round by round: a lent machine's host
    # speed drifts by 10-20% between minutes, which one pass per case would read as a LoRA cost
    # a share of the GPU counts what is in use already: the second engine asks for the first's too
    base_llm = LLM(str(d), gpu_memory_utilization=0.3, **common)
    run(base_llm, prompts, [8] * len(prompts), [None])  # warm-up: every prompt shape
    res["batch1_base_ms"] = batch1_ms(base_llm, prompts[0][:128], None)
    llm = LLM(str(d), enable_lora=True, max_loras=4, max_lora_rank=args.rank, gpu_memory_utilization=0.65,
              **common)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    for r in loras:
        llm.engine.add_lora(r.lora_name, r.lora_path)
    runner = llm.engine.runner
    res["route"] = fp.gb.decode_route(runner)
    run(llm, prompts, [8] * len(prompts), loras)
    cases = (("base", base_llm, [None]), ("base, LoRA on", llm, [None]), ("1 adapter", llm, loras[:1]),
             ("4 adapters", llm, loras))
    rounds: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for i in range(args.rounds):
        for name, engine, chosen in cases:
            engine.engine.runner.route_counts.clear()
            rounds[name].append(sum(outs) / run(engine, prompts, outs, chosen))
            res[f"{name} routes"] = dict(engine.engine.runner.route_counts)
            print(f"round {i}: {name}: {rounds[name][-1]:.0f} tok/s, routes {res[f'{name} routes']}", flush=True)
    for name in rounds:
        res[name] = statistics.median(rounds[name])
        res[f"{name} rounds"] = rounds[name]
    res["batch1_lora_base_ms"] = batch1_ms(llm, prompts[0][:128], None)
    res["batch1_lora_ms"] = batch1_ms(llm, prompts[0][:128], loras[0])
    print(f"batch-1 ms/token: base {res['batch1_base_ms']:.3f}, LoRA engine on the base "
          f"{res['batch1_lora_base_ms']:.3f}, adapter {res['batch1_lora_ms']:.3f}", flush=True)
    short = [p[:32] for p in prompts[:4]]
    res["logprob_error_base"] = logprob_error(llm, d, None, None, short)
    res["logprob_error_adapter"] = logprob_error(llm, d, adapters[0], loras[0], short)
    print("logprob error vs transformers+peft:", res["logprob_error_base"], res["logprob_error_adapter"], flush=True)
    lines = [f"| case | output tok/s (median of {args.rounds}) | vs base | rounds |", "|---|---|---|---|"]
    for name in rounds:
        each = ", ".join(f"{x:.0f}" for x in rounds[name])
        lines.append(f"| {name} | {res[name]:.0f} | {res[name] / res['base']:.3f} | {each} |")
    text = (f"{args.shape}, {args.num_seqs} sequences, rank {args.rank}, decode route with LoRA: {res['route']}\n\n"
            + "\n".join(lines) + f"\n\nbatch-1 ms/token: base {res['batch1_base_ms']:.3f}, "
            f"LoRA engine on the base {res['batch1_lora_base_ms']:.3f}, adapter {res['batch1_lora_ms']:.3f}\n\n"
            f"logprob |ours - transformers(+peft)|, bf16, 4 prompts x 16 "
            f"tokens: base max {res['logprob_error_base']['max']:.3f} mean {res['logprob_error_base']['mean']:.4f}; "
            f"adapter max {res['logprob_error_adapter']['max']:.3f} mean {res['logprob_error_adapter']['mean']:.4f}\n")
    (out / "gpu_lora.md").write_text(text)
    (out / "gpu_lora.json").write_text(json.dumps(res, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
