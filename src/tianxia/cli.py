"""The ``tianxia`` command line: ``run``, ``chat``, ``serve``, ``pull``, ``models``.

``run`` and ``chat`` follow llama.cpp's flags (``-m -p -n -c -t --temp --seed``). Every expected
failure (unknown model, bad file, bad parameter) ends in a one-line ``error:`` message and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from tianxia import __version__
from tianxia.config import (
    add_offload_args,
    add_parallel_args,
    add_quantization_args,
    add_speculative_args,
    kv_cache_dtype_from_args,
    speculative_from_args,
)

if TYPE_CHECKING:
    from tianxia import SamplingParams
    from tianxia.outputs import RequestOutput

DEFAULT_MODEL = "smollm2-135m"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help="pulled model name, .gguf path or Hugging Face directory (default: %(default)s)")
    p.add_argument("-c", "--ctx-size", "--max-model-len", dest="max_model_len", type=int, default=None,
                   help="context length (default: the model's, capped by the KV cache)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU intra-op threads (default: the physical cores)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size, e.g. 2GiB")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    add_quantization_args(p)
    add_speculative_args(p)
    add_parallel_args(p)
    add_offload_args(p)
    p.add_argument("--seed", "-s", type=int, default=None, help="sampling seed")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the reply where TEXT appears (not printed); repeat for several")
    p.add_argument("--chat-template", default=None, help="Jinja chat template overriding the model's")
    p.add_argument("--log-level", default="warning", help="debug, info, warning, error")
    p.add_argument("--lora", action="append", default=[], metavar="PATH",
                   help="apply a LoRA adapter (a PEFT directory); repeat for several, their deltas add up")
    p.add_argument("--lora-scaled", nargs=2, action="append", default=[], metavar=("PATH", "SCALE"),
                   help="apply a LoRA adapter with its delta times SCALE")


def _make_llm(args: argparse.Namespace):
    from tianxia import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed if args.seed is not None else 0,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        threads=args.threads,
        chat_template=args.chat_template,
        quantization=args.quantization,
        kv_cache_dtype=kv_cache_dtype_from_args(args),
        calculate_kv_scales=args.calculate_kv_scales,
        cpu_activations=args.cpu_activations,
        batch_invariant=args.batch_invariant,
        speculative_config=speculative_from_args(args),
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_offload_gb=args.cpu_offload_gb,
        n_gpu_layers=args.n_gpu_layers,
        master_addr=args.master_addr,
        master_port=args.master_port,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        enable_lora=bool(_lora_sources(args)),
        max_lora_rank=_cli_max_lora_rank(_lora_sources(args)),
    )


# llama.cpp puts no bound on an adapter's rank; the server's --max-lora-rank is a batch budget
_CLI_MAX_LORA_RANK = 4096


def _cli_max_lora_rank(sources: list[tuple[str, float]]) -> int:
    """The rank of ``--lora`` adapters summed (they are applied together), read from their PEFT
    configs, so a GPU's stacked adapter buffers are no wider than the adapters; else the bound."""
    from tianxia.layers.lora import LoRAError, read_peft_config

    try:
        return max(1, sum(read_peft_config(path)["r"] for path, _ in sources))
    except LoRAError:  # a GGUF adapter, or a bad one (loading it reports why)
        return _CLI_MAX_LORA_RANK


def _lora_sources(args: argparse.Namespace) -> list[tuple[str, float]]:
    sources = [(path, 1.0) for path in args.lora]
    for path, scale in args.lora_scaled:
        try:
            sources.append((path, float(scale)))
        except ValueError:
            raise ValueError(f"--lora-scaled {path} {scale}: the scale must be a number") from None
    return sources


def _lora_request(llm, args: argparse.Namespace):
    """The request adapter of ``--lora`` / ``--lora-scaled`` (registered once), or None."""
    from tianxia.engine.lora_manager import LoRARequest

    sources = _lora_sources(args)
    if not sources:
        return None
    if "cli" not in llm.engine.list_loras():
        llm.engine.add_lora("cli", sources)
    return LoRARequest("cli")


def _params(args: argparse.Namespace, max_tokens: int | None) -> SamplingParams:
    from tianxia import SamplingParams

    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=max_tokens, stop=args.stop or None,
    )


def _stream(llm, prompt, params: SamplingParams, lora=None) -> tuple[RequestOutput, float | None]:
    """Generate one request, writing its text to stdout as it comes; returns the final output and
    when its first token came.

    The text is made as the server makes it, by one path: the engine runs the request for tokens
    only (``engine_params``), an ``OutputProcessor`` turns them into text and ends it at a stop
    string, and only the text up to the output's ``stable_len`` (none of a held-back stop string
    or unfinished character) is written."""
    from tianxia.engine.output_processor import OutputProcessor, engine_params

    engine = llm.engine
    rid = f"cli-{time.monotonic_ns()}"
    processor = OutputProcessor(engine.tokenizer)
    processor.add(rid, params)
    engine.add_request(rid, prompt, engine_params(params), lora)
    final, t_first, printed = None, None, 0
    while final is None:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the engine finished without the request's last output")
        for delta in engine.step_deltas():
            processed = processor.process(delta)
            if processed is None:
                continue
            output = processed.output
            if processed.stop_request:  # a stop string ended it here; the engine would run on
                engine.abort_request(rid)
            (choice,) = output.outputs
            if t_first is None and choice.token_ids:
                t_first = time.perf_counter()
            sys.stdout.write(choice.text[printed:choice.stable_len])
            sys.stdout.flush()
            printed = max(printed, choice.stable_len)
            if output.finished:
                final = output
    return final, t_first


def _print_timings(n_prompt: int, n_gen: int, t_prompt: float, t_gen: float, speculator=None) -> None:
    pp = n_prompt / t_prompt if t_prompt > 0 else float("inf")
    tg = (n_gen - 1) / t_gen if n_gen > 1 and t_gen > 0 else float("nan")
    print(
        f"\n\nprompt eval: {n_prompt} tokens in {t_prompt * 1000:.1f} ms ({pp:.2f} tokens/s)\n"
        f"generation:  {n_gen} tokens in {(t_prompt + t_gen) * 1000:.1f} ms total "
        f"({tg:.2f} tokens/s after the first)",
        file=sys.stderr,
    )
    if speculator is not None:
        # llama.cpp's "draft acceptance rate" line
        print(f"speculative: {speculator.config.method}, {speculator.num_draft_tokens} tokens proposed, "
              f"{speculator.num_accepted_tokens} accepted (acceptance rate {speculator.acceptance_rate:.3f}) "
              f"in {speculator.num_drafts} verifications", file=sys.stderr)


def _serve_node(args: argparse.Namespace, model: str) -> int:
    """``--node-rank`` > 0: this node's tensor-parallel worker ranks only; rank 0 (node 0) sends
    them its settings."""
    from tianxia.config import EngineConfig
    from tianxia.distributed.nodes import serve_node

    return serve_node(EngineConfig(
        model=model, device=args.device, threads=args.threads, tensor_parallel_size=args.tensor_parallel_size,
        master_addr=args.master_addr, master_port=args.master_port, nnodes=args.nnodes, node_rank=args.node_rank))


def cmd_run(args: argparse.Namespace) -> int:
    if args.node_rank > 0:
        return _serve_node(args, args.model)
    llm = _make_llm(args)
    prompt = args.prompt
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompt = f.read()
    if prompt is None:
        raise ValueError("no prompt: pass -p PROMPT or -f FILE")
    if args.conversation:
        prompt = {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": prompt}])}
    else:
        print(prompt, end="", flush=True)
    n = args.n_predict if args.n_predict and args.n_predict > 0 else None
    t0 = time.perf_counter()
    out, t_first = _stream(llm, prompt, _params(args, n), _lora_request(llm, args))
    t_end = time.perf_counter()
    t_first = t_first or t_end
    _print_timings(len(out.prompt_token_ids), len(out.outputs[0].token_ids), t_first - t0,
                   t_end - t_first, llm.engine.speculator)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    if args.node_rank > 0:
        return _serve_node(args, args.model)
    llm = _make_llm(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    lora = _lora_request(llm, args)
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat with the model; Ctrl-D or /exit to quit, /reset to start over", file=sys.stderr)
    while True:
        if interactive:
            print("\n> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system_prompt else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = llm.apply_chat_template(messages)
        params = _params(args, args.n_predict if args.n_predict and args.n_predict > 0 else None)
        out, _ = _stream(llm, {"prompt_token_ids": ids}, params, lora)
        print()
        messages.append({"role": "assistant", "content": out.outputs[0].text})


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray_replicas is not None:
        from tianxia.ray.local import run_local

        return run_local(args, args.argv, DEFAULT_MODEL)
    if args.node_rank > 0:  # no engine, no HTTP server
        return _serve_node(args, args.model_tag or (args.model[0] if args.model else DEFAULT_MODEL))
    from tianxia.server import run_server

    return run_server(args, DEFAULT_MODEL)


def build_parser() -> argparse.ArgumentParser:
    from tianxia.loader import hub

    parser = argparse.ArgumentParser(prog="tianxia", description="LLM inference engine")
    parser.add_argument("--version", action="version", version=f"tianxia {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate text for one prompt (llama.cpp style)")
    _add_engine_args(run)
    run.add_argument("-p", "--prompt", default=None)
    run.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    run.add_argument("-n", "--n-predict", type=int, default=128,
                     help="tokens to generate, -1 = until EOS or the context is full (default: %(default)s)")
    run.add_argument("-cnv", "--conversation", action="store_true",
                     help="wrap the prompt in the model's chat template")
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _add_engine_args(chat)
    chat.add_argument("-n", "--n-predict", type=int, default=-1)
    chat.add_argument("-sys", "--system-prompt", default=None)
    chat.set_defaults(func=cmd_chat)

    from tianxia.server.launcher import add_serve_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vllm serve style)")
    add_serve_args(serve, DEFAULT_MODEL)
    serve.add_argument(
        "--ray-replicas", type=int, default=None, metavar="N",
        help="N replicas on a local Ray Serve instance behind one ingress, with prefix-aware "
        "routing (needs tianxia[ray]; docs/SCALING.md)",
    )
    serve.set_defaults(func=cmd_serve)

    hub.add_pull_parser(sub)
    hub.add_models_parser(sub)

    from tianxia.bench.cli import add_bench_parser
    from tianxia.doctor import add_doctor_parser

    add_bench_parser(sub)
    add_doctor_parser(sub)

    from tianxia.tools import add_tool_parsers

    add_tool_parsers(sub)  # convert, quantize, perplexity

    from tianxia.build import add_build_parser

    add_build_parser(sub)  # build: GPU kernels compiled, autotuned and cached ahead of serve
    return parser


def main(argv: list[str] | None = None) -> int:
    from tianxia.loader.errors import ModelLoadError
    from tianxia.loader.hub import ModelNotFoundError, PullError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --ray-replicas passes them on
    level = getattr(args, "log_level", "warning").upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, ModelLoadError, ModelNotFoundError, PullError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
