"""llama.cpp-style tools: ``convert`` (HF -> GGUF), ``quantize`` (GGUF -> GGUF), ``perplexity``."""

from __future__ import annotations

import argparse
import sys


def cmd_convert(args: argparse.Namespace) -> int:
    from tianxia.tools.convert import convert

    info = convert(args.model_dir, args.outfile, args.outtype, progress=not args.quiet)
    print(f"wrote {args.outfile}: {info['architecture']}, {info['tensors']} tensors, "
          f"{info['params'] / 1e6:.1f}M params, {info['bytes'] / 2**20:.1f} MiB ({info['outtype']}) "
          f"in {info['seconds']:.1f}s")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from tianxia.quant.quantize import quantize_gguf, resolve_ftype

    name = resolve_ftype(args.type)[0]
    report = quantize_gguf(args.input, args.output, args.type, pure=args.pure, progress=not args.quiet)
    print(report.summary(name))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from tianxia.config import kv_cache_dtype_from_args
    from tianxia.tools.perplexity import run_perplexity

    result = run_perplexity(
        args.model, args.file, ctx=args.ctx_size, chunks=args.chunks, batch=args.batch_size,
        threads=args.threads, dtype=args.dtype, progress=not args.quiet,
        kv_cache_dtype=kv_cache_dtype_from_args(args), cpu_activations=args.cpu_activations,
        calculate_kv_scales=args.calculate_kv_scales,
    )
    print(result.summary(), file=sys.stdout)
    return 0


def add_tool_parsers(sub) -> None:
    from tianxia.config import CPU_ACTIVATIONS, add_kv_cache_args

    conv = sub.add_parser("convert", help="convert a Hugging Face model directory to GGUF")
    conv.add_argument("model_dir")
    conv.add_argument("outfile")
    conv.add_argument("--outtype", default="f16", choices=("f32", "f16", "bf16", "q8_0"))
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    quant = sub.add_parser("quantize", help="quantize a GGUF file (llama-quantize type mixes)")
    quant.add_argument("input")
    quant.add_argument("output")
    quant.add_argument("type", help="Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K(_M) Q4_K(_M) Q4_K_S Q5_K(_M) Q6_K F16 BF16 F32")
    quant.add_argument("--pure", action="store_true",
                       help="one type for every quantizable tensor (no mix rules), as llama-quantize --pure")
    quant.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=cmd_quantize)

    ppl = sub.add_parser("perplexity", help="perplexity over a text file (llama-perplexity's method)")
    ppl.add_argument("-m", "--model", required=True)
    ppl.add_argument("-f", "--file", required=True, help="text file")
    ppl.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    ppl.add_argument("-b", "--batch-size", type=int, default=2048, help="tokens per forward pass")
    ppl.add_argument("--chunks", type=int, default=-1, help="at most this many chunks (-1: all)")
    ppl.add_argument("-t", "--threads", type=int, default=None)
    ppl.add_argument("--dtype", default="float32")
    add_kv_cache_args(ppl)
    ppl.add_argument("--cpu-activations", default="int8", choices=list(CPU_ACTIVATIONS),
                     help="the CPU path to measure, as run and serve take it (default: %(default)s)")
    ppl.add_argument("-q", "--quiet", action="store_true", help="no per-chunk output")
    ppl.set_defaults(func=cmd_perplexity)
