"""A GGUF of trained weights small enough to travel to a GPU machine (a 64 MiB upload).

Random default-init weights have flat logits, so greedy agreement on them says little; SmolLM2-135M
(the default model) has trained ones, but its 576-wide rows cannot take the k-quants (they need
rows in multiples of 256, so llama.cpp and ``tianxia quantize`` fall back to Q4_0 there), and the
smallest file of all 30 layers is about 76 MB. This keeps the first ``--layers`` blocks (the
embedding, the final norm and the tied output head stay), then quantizes with ``tianxia quantize
--pure Q2_K`` (Q2_K where rows allow, Q4_0 elsewhere). The result is a real, smaller model of
the same family whose logits are as peaked as trained weights make them; the GPU check compares
tianxia with ``transformers`` on this same file.

    python benchmarks/gpu_test_model.py OUT.gguf [--layers 20]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path


def truncate_layers(src: Path, dst: Path, layers: int) -> None:
    import gguf
    import numpy as np

    from tianxia.quant.quantize import _copy_metadata

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    count = f"{arch}.block_count"
    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, skip={"general.architecture", count})
    writer.add_uint32(count, layers)
    keep = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= layers:
            continue
        keep.append(t)
        shape = [int(d) for d in t.shape]
        writer.add_tensor_info(t.name, [*reversed(shape[1:]), int(t.n_bytes) // int(np.prod(shape[1:]))]
                               if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
                               else list(reversed(shape)),
                               np.dtype(np.uint8) if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                                                          gguf.GGMLQuantizationType.F16)
                               else t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(np.ascontiguousarray(t.data))
    writer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--type", default="Q2_K")
    args = ap.parse_args()
    from tianxia.loader.hub import pull
    from tianxia.quant.quantize import quantize_gguf

    src = pull(args.model, quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        cut = Path(tmp) / "cut.gguf"
        truncate_layers(src, cut, args.layers)
        report = quantize_gguf(cut, args.out, args.type, pure=True, progress=False)
    print(report.summary(args.type))
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
