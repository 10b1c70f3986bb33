"""GGUF -> GGUF quantization with llama.cpp's type mixes (``llama-quantize``).

Which tensor gets which type follows ``llama_tensor_get_type`` in llama.cpp's ``llama-quant.cpp``
(no importance matrix): the mix's base type for every quantizable weight, then per-category
bumps (``attn_v``, ``ffn_down``, ``attn_output``, ``attn_qkv``; the output / tied embedding in
Q6_K), then the fallback for rows not divisible by the block (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, then F16). Only 2-D ``*weight`` tensors that are not norms or
position embeddings are quantized; everything else is copied unchanged.

Encoders: ``gguf.quants.quantize`` for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16 (the gguf package's
reference ports), :mod:`tianxia.quant.kquants` for the k-quants.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT

from tianxia.quant.kquants import KQUANTIZERS

# CLI name -> (llama.cpp file type, base tensor type)
FTYPES: dict[str, tuple[FT, QT]] = {
    "Q4_0": (FT.MOSTLY_Q4_0, QT.Q4_0),
    "Q4_1": (FT.MOSTLY_Q4_1, QT.Q4_1),
    "Q5_0": (FT.MOSTLY_Q5_0, QT.Q5_0),
    "Q5_1": (FT.MOSTLY_Q5_1, QT.Q5_1),
    "Q8_0": (FT.MOSTLY_Q8_0, QT.Q8_0),
    "Q2_K": (FT.MOSTLY_Q2_K, QT.Q2_K),
    "Q3_K_M": (FT.MOSTLY_Q3_K_M, QT.Q3_K),
    "Q4_K_S": (FT.MOSTLY_Q4_K_S, QT.Q4_K),
    "Q4_K_M": (FT.MOSTLY_Q4_K_M, QT.Q4_K),
    "Q5_K_M": (FT.MOSTLY_Q5_K_M, QT.Q5_K),
    "Q6_K": (FT.MOSTLY_Q6_K, QT.Q6_K),
    "F16": (FT.MOSTLY_F16, QT.F16),
    "BF16": (FT.MOSTLY_BF16, QT.BF16),
    "F32": (FT.ALL_F32, QT.F32),
}
# llama-quantize's aliases: a bare k-quant name means its _M mix
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
_GGUF_QUANTS = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.F16, QT.BF16}
_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def resolve_ftype(name: str) -> tuple[str, FT, QT]:
    key = name.upper()
    key = ALIASES.get(key, key)
    if key not in FTYPES:
        names = sorted(set(FTYPES) | set(ALIASES))
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(names)}")
    return (key, *FTYPES[key])


def block_size(qtype: QT) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][0]


def quantize_array(x: np.ndarray, qtype: QT) -> np.ndarray:
    """Encode float32 ``(rows, cols)`` as GGUF bytes ``(rows, row_bytes)`` (or a typed array)."""
    import gguf

    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == QT.F32:
        return x
    if qtype in _GGUF_QUANTS:
        return gguf.quants.quantize(x, qtype)
    fn = KQUANTIZERS.get(qtype.name)
    if fn is None:
        raise ValueError(f"quantizing to {qtype.name} is not supported")
    rows, cols = x.shape
    out = []
    step = max(1, (1 << 20) // cols)  # ~1M values per chunk keeps the temporaries small
    for r in range(0, rows, step):
        chunk = x[r : r + step]
        out.append(fn(chunk.reshape(-1, 256)).reshape(chunk.shape[0], -1))
    return np.concatenate(out)


@dataclass
class _State:
    """llama.cpp's ``quantize_state_impl`` counters (non-MoE)."""

    n_attention_wv: int = 0
    n_layer: int = 0
    n_gqa: int = 1
    has_output: bool = False
    arch: str = ""
    i_attention_wv: int = 0


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for frag, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_v.weight", "attn_v"),
                      ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                      ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"),
                      ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if frag in name:
            return cat
    return "other"


def allows_quantization(name: str, ndim: int) -> bool:
    return (
        ndim >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and name != "position_embd.weight"
        and "ffn_gate_inp.weight" not in name
    )


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def choose_type(name: str, cols: int, ftype: FT, base: QT, st: _State) -> QT:
    """``llama_tensor_get_type_impl`` + ``tensor_type_fallback`` for the mixes listed in FTYPES."""
    cat = _category(name)
    new = base
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else 0
    n = st.n_layer
    falcon = st.arch == "falcon"
    if cat == "output" or (not st.has_output and cat == "token_embd"):
        if falcon or cols % block_size(new) != 0:
            new = QT.Q8_0
        elif new != QT.Q8_0:
            new = QT.Q6_K
    if cat in ("attn_v", "attn_qkv"):  # llama.cpp's category_is_attn_v: fused qkv counts as attn_v
        i = st.i_attention_wv
        if ftype == FT.MOSTLY_Q2_K:
            new = QT.Q4_K if st.n_gqa >= 4 else QT.Q3_K
        elif ftype == FT.MOSTLY_Q3_K_M:
            new = QT.Q5_K if i < 2 else QT.Q4_K
        elif ftype in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M) and _use_more_bits(i, st.n_attention_wv):
            new = QT.Q6_K
        elif ftype == FT.MOSTLY_Q4_K_S and i < 4:
            new = QT.Q5_K
        st.i_attention_wv += 1
    elif cat == "ffn_down":
        if ftype == FT.MOSTLY_Q2_K:
            new = QT.Q3_K
        elif ftype == FT.MOSTLY_Q3_K_M:
            new = (QT.Q5_K if layer < n // 16
                   else QT.Q4_K if not falcon or _use_more_bits(layer, n) else QT.Q3_K)
        elif ftype == FT.MOSTLY_Q4_K_M:
            if falcon:
                new = (QT.Q6_K if layer < n // 16
                       else QT.Q5_K if _use_more_bits(layer, n) else QT.Q4_K)
            elif _use_more_bits(layer, n):
                new = QT.Q6_K
        elif ftype == FT.MOSTLY_Q5_K_M and _use_more_bits(layer, n):
            new = QT.Q6_K
        elif ftype == FT.MOSTLY_Q4_K_S and not falcon and layer < n // 8:
            new = QT.Q5_K
    elif cat == "attn_output" and not falcon:
        if ftype == FT.MOSTLY_Q2_K:
            new = QT.Q3_K
        elif ftype == FT.MOSTLY_Q3_K_M:
            new = QT.Q4_K
    # incompatible row lengths fall back to a type with a smaller block
    if new not in (QT.F32, QT.F16, QT.BF16) and cols % block_size(new) != 0:
        new = _FALLBACK.get(new, new)
        if cols % block_size(new) != 0:
            new = QT.F16
    return new


@dataclass
class QuantizeReport:
    in_bytes: int = 0
    out_bytes: int = 0
    n_params: int = 0
    types: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.in_bytes / max(1, self.out_bytes)

    def summary(self, ftype: str) -> str:
        bpw = 8 * self.out_bytes / max(1, self.n_params)
        mix = ", ".join(f"{k} x{v}" for k, v in sorted(self.types.items()))
        return (
            f"{ftype}: {self.in_bytes / 2**20:.1f} MiB -> {self.out_bytes / 2**20:.1f} MiB "
            f"(ratio {self.ratio:.2f}x, {bpw:.2f} bits/weight) in {self.seconds:.1f}s\n"
            f"tensor types: {mix}"
        )


def _copy_metadata(reader, writer, skip: set[str]) -> None:
    from gguf import GGUFValueType

    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)


def quantize_gguf(
    src: str | Path, dst: str | Path, type_name: str, *, pure: bool = False, progress: bool = True
) -> QuantizeReport:
    """Quantize the GGUF file ``src`` into ``dst`` with llama.cpp's mix ``type_name``."""
    import gguf

    from tianxia.quant.gguf_codecs import dequantize

    t0 = time.perf_counter()
    ftype_name, ftype, base = resolve_ftype(type_name)
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    names = [t.name for t in reader.tensors]
    st = _State(arch=arch, has_output="output.weight" in names)
    st.n_attention_wv = sum(1 for n in names if _category(n) in ("attn_v", "attn_qkv"))
    nl = reader.fields.get(f"{arch}.block_count")
    st.n_layer = int(nl.contents()) if nl else 0
    heads, kv = reader.fields.get(f"{arch}.attention.head_count"), reader.fields.get(f"{arch}.attention.head_count_kv")
    if heads is not None and kv is not None and int(kv.contents()):
        st.n_gqa = int(heads.contents()) // int(kv.contents())

    # pass 1: decide every tensor's type, so the header can be written before the data.
    # llama.cpp walks the tensors ordered by (layer number, name) (its weight_name_comparer), and
    # its attn_v / ffn_down counters count in that order; so do we, and we write in it too.
    def order(t) -> tuple[int, str]:
        m = re.match(r"blk\.(\d+)\.", t.name)
        return (int(m.group(1)) if m else -1, t.name)

    plan = []
    for t in sorted(reader.tensors, key=order):
        shape = [int(d) for d in t.shape]  # GGUF order: ne0 (row length) first
        cols = shape[0]
        if not allows_quantization(t.name, len(shape)):
            new = t.tensor_type
        elif base in (QT.F32, QT.F16, QT.BF16):  # not a quantized type: no mix rules apply
            new = base
        elif pure:
            new = choose_type("", cols, FT.ALL_F32, base, _State())  # only the fallback applies
            if t.name == "output.weight" or (not st.has_output and t.name == "token_embd.weight"):
                new = base if cols % block_size(base) == 0 else new
        else:
            new = choose_type(t.name, cols, ftype, base, st)
        plan.append((t, new))

    writer = gguf.GGUFWriter(str(dst), arch)
    _copy_metadata(reader, writer, skip={"general.architecture", "general.file_type",
                                         "general.quantization_version"})
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    report = QuantizeReport()
    for t, new in plan:
        shape = [int(d) for d in t.shape]
        n = int(np.prod(shape))
        bs, ts = gguf.GGML_QUANT_SIZES[new]
        nbytes = n // bs * ts
        byte_shape = [*reversed(shape[1:]), shape[0] // bs * ts]
        writer.add_tensor_info(t.name, byte_shape if new not in (QT.F32, QT.F16) else list(reversed(shape)),
                               np.dtype(np.uint8) if new not in (QT.F32, QT.F16) else
                               np.dtype(np.float32 if new == QT.F32 else np.float16),
                               nbytes, raw_dtype=new)
        report.types[new.name] = report.types.get(new.name, 0) + 1
        report.in_bytes += int(t.n_bytes)
        report.out_bytes += nbytes
        report.n_params += n
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    from tqdm import tqdm

    bar = tqdm(plan, desc=f"quantize {ftype_name}", unit="tensor", file=sys.stderr, disable=not progress)
    for t, new in bar:
        shape = [int(d) for d in t.shape]
        rows_shape = tuple(reversed(shape))
        if new == t.tensor_type:
            data = np.asarray(t.data)
        else:
            x = dequantize(np.asarray(t.data), t.tensor_type, rows_shape).numpy().reshape(-1, shape[0])
            data = quantize_array(x, new)
            if new == QT.F16:
                data = data.astype(np.float16)
        bar.set_postfix_str(f"{t.name} -> {new.name}")
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    report.seconds = time.perf_counter() - t0
    report.out_bytes = Path(dst).stat().st_size
    report.in_bytes = Path(src).stat().st_size
    return report
