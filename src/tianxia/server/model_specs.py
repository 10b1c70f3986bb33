"""Which models a server with several serves: ``--model NAME=MODEL`` and ``--models-dir DIR``
(llama.cpp's router flags), each model's name, and what its weights will take before it loads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def split_model_arg(value: str) -> tuple[str | None, str]:
    """``NAME=MODEL`` or ``MODEL``; a value that is an existing path is a model, ``=`` or not."""
    if "=" in value and not Path(value).expanduser().exists():
        name, _, spec = value.partition("=")
        name, spec = name.strip(), spec.strip()
        if not name or not spec:
            raise ValueError(f"--model {value!r}: expected NAME=MODEL or MODEL")
        return name, spec
    return None, value


def name_of(spec: str) -> str:
    """A model's name where none is given: a file's name without ``.gguf``, a directory's name,
    else the spec itself (a pulled name or a Hugging Face id)."""
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        return path.stem if path.is_file() and path.suffix.lower() == ".gguf" else path.name
    return spec


def _is_model_dir(path: Path) -> bool:
    """A Hugging Face directory, or a directory holding exactly one ``.gguf`` file (as a pulled
    model's is)."""
    if (path / "config.json").is_file():
        return True
    return len([p for p in path.glob("*.gguf") if not p.name.startswith(".")]) == 1


def scan_models_dir(directory: str) -> list[tuple[str, str]]:
    """``(name, path)`` of each model in ``directory``: every ``.gguf`` file (named after the file
    without ``.gguf``) and every model directory (named after the directory), sorted by name."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory!r} is not a directory")
    found = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_file() and p.suffix.lower() == ".gguf":
            found.append((p.stem, str(p)))
        elif p.is_dir() and _is_model_dir(p):
            found.append((p.name, str(p)))
    if not found:
        raise ValueError(
            f"--models-dir {directory!r} holds no model (.gguf files, or directories with a "
            "config.json or one .gguf file)"
        )
    return found


def weights_on_disk(spec: str) -> int:
    """The bytes of a model's weight files: what its weights take once loaded on CPU, where GGUF
    block-quantized matrices stay packed (measured: SmolLM2 Q4_1 93 MiB on disk and in memory,
    Qwen2.5-Coder-0.5B 468 MiB on disk, 483 MiB in memory). 16-bit safetensors loaded as float32
    take twice their size; the first load measures the real figure, which replaces this one."""
    from tianxia.loader.hub import resolve_model

    try:
        path = resolve_model(spec, pull_missing=False)
    except Exception:  # noqa: BLE001 - an unresolvable model fails at its load, with the reason
        path = Path(spec).expanduser()
    if path.is_file():
        return path.stat().st_size
    total = 0
    with contextlib.suppress(OSError):
        for p in path.iterdir():
            if p.suffix in (".safetensors", ".bin", ".gguf"):
                total += p.stat().st_size * (2 if p.suffix != ".gguf" else 1)
    return total


def available_memory(device: str) -> int:
    """What the models may hold by default: the device's free memory (CUDA) or the system's
    available memory (CPU) when the server starts."""
    import torch

    from tianxia.engine.llm_engine import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    return avail
