"""``tianxia doctor``: what this machine has and which tianxia features will work.

One line per check: ``[ ok ]``, ``[info]``, ``[warn]`` or ``[FAIL]``, a name, what was found, and
for anything missing a ``fix:``. Every check is isolated: one that breaks reports ``[FAIL]`` and
the rest still run. ``--json`` prints the same as a list of objects. The exit status is 0 unless
``--strict`` is given and some check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def line(self, width: int = 22) -> str:
        s = f"[{self.status:^4}] {self.name:<{width}} {self.detail}"
        if self.fix:
            s += f"\n       {'':<{width}} fix: {self.fix}"
        return s


# ----------------------------------------------------------------------------- probes


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def cpu_info() -> dict:
    info = {"model": platform.processor() or platform.machine(), "flags": set(),
            "arch": platform.machine()}
    text = _read("/proc/cpuinfo") or ""
    m = re.search(r"^(?:model name|Model|Hardware|cpu model)\s*:\s*(.+)$", text, re.MULTILINE)
    if m:
        info["model"] = m.group(1).strip()
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.MULTILINE)
    if m:
        info["flags"] = set(m.group(1).split())
    phys = set(re.findall(r"^physical id\s*:\s*(\d+)[\s\S]*?^core id\s*:\s*(\d+)", text, re.MULTILINE))
    info["physical_cores"] = len(phys) or None
    if sys.platform == "darwin" and not info["flags"]:
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                 text=True, timeout=5, check=False).stdout.strip()
            info["model"] = out or info["model"]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cgroup_cpu_limit() -> float | None:
    text = _read("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    q, p = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if q and p and int(q) > 0:
        return int(q) / int(p)
    return None


def mem_info() -> dict:
    out = {}
    text = _read("/proc/meminfo") or ""
    for key in ("MemTotal", "MemAvailable"):
        m = re.search(rf"^{key}:\s*(\d+) kB", text, re.MULTILINE)
        if m:
            out[key] = int(m.group(1)) * 1024
    lim = _read("/sys/fs/cgroup/memory.max") or _read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if lim and lim.strip().isdigit() and int(lim) < (1 << 60):
        out["cgroup_limit"] = int(lim)
    if not out and hasattr(os, "sysconf"):
        try:
            out["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- checks


X86_FLAGS = [("sse4_2", "SSE4.2"), ("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"),
             ("f16c", "F16C"), ("avx512f", "AVX-512F"), ("avx512bw", "AVX-512BW"),
             ("avx512_vnni", "AVX-512 VNNI"), ("avx512_bf16", "AVX-512 BF16"),
             ("avx512_fp16", "AVX-512 FP16"), ("avx_vnni", "AVX-VNNI"), ("amx_tile", "AMX"),
             ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8")]
ARM_FLAGS = [("asimd", "NEON"), ("asimddp", "dotprod"), ("sve", "SVE"), ("sve2", "SVE2"),
             ("bf16", "BF16"), ("i8mm", "I8MM")]


def check_python() -> list[Check]:
    v = sys.version_info
    st = OK if v >= (3, 10) else FAIL
    return [Check("python", st, f"{platform.python_version()} ({sys.executable})",
                  None if st == OK else "tianxia needs Python 3.10 or newer")]


def check_tianxia() -> list[Check]:
    import tianxia

    where = Path(tianxia.__file__).parent
    return [Check("tianxia", OK, f"{tianxia.__version__} at {where}")]


def check_cpu() -> list[Check]:
    info = cpu_info()
    flags = info["flags"]
    checks = [Check("cpu", OK, f"{info['model']} ({info['arch']})")]
    table = X86_FLAGS if info["arch"] in ("x86_64", "AMD64", "i686") else ARM_FLAGS
    have = [name for f, name in table if f in flags]
    missing = [name for f, name in table if f not in flags]
    if not flags:
        checks.append(Check("cpu flags", INFO, "not readable on this platform"))
    else:
        checks.append(Check("cpu flags", OK, "has " + (", ".join(have) or "none of the SIMD sets")
                            + (f"; lacks {', '.join(missing)}" if missing else "")))
        if table is X86_FLAGS:
            checks.extend(check_kernel_isa())
        if table is X86_FLAGS and "avx2" not in flags:
            checks.append(Check("simd", WARN, "no AVX2: torch's CPU kernels fall back to slow paths",
                                "run on a CPU with AVX2 (any x86 CPU since ~2013)"))
    logical = os.cpu_count() or 1
    usable = usable_cores()
    quota = cgroup_cpu_limit()
    detail = f"{usable} usable of {logical} logical"
    if info.get("physical_cores"):
        detail += f", {info['physical_cores']} physical"
    if quota:
        detail += f", cgroup quota {quota:g} CPUs"
    st, fix = OK, None
    if quota and quota + 0.01 < usable:
        st, fix = WARN, f"pass -t {max(1, int(quota))} (threads above the CPU quota only contend)"
    checks.append(Check("cores", st, detail, fix))
    return checks


def check_kernel_isa() -> list[Check]:
    """The instruction set tianxia's CPU kernels will use here (from the CPU's flags and
    TIANXIA_CPU_ISA, without building them), and AMX's state."""
    from tianxia.quant import cpu_isa

    best, isa = cpu_isa.best_available(), cpu_isa.choose()
    scope = {"avx512": " (for the 8-bit-activation products of several rows; AVX2 elsewhere)",
             "amx": " (for the 8-bit-activation products of many rows, AVX-512 VNNI for a few, AVX2 elsewhere)"}
    detail = cpu_isa.NAMES[isa] + scope.get(isa, "") + (
        f" (forced by {cpu_isa.ENV}; best here: {cpu_isa.NAMES[best]})" if isa != best else "")
    st = WARN if isa == "none" else OK
    fix = None
    if isa == "none" and best != "none":
        fix = f"unset {cpu_isa.ENV} to use the C++ kernels"
    elif isa == "none":
        fix = "run on a CPU with AVX2, FMA and F16C for tianxia's CPU kernels"
    return [Check("cpu kernels isa", st, detail, fix), Check("amx", INFO, cpu_isa.amx_status())]


def check_memory() -> list[Check]:
    m = mem_info()
    if not m:
        return [Check("memory", INFO, "unknown on this platform")]
    total = m.get("MemTotal")
    avail = m.get("MemAvailable")
    detail = f"{_gib(total)} total" if total else ""
    if avail:
        detail += f", {_gib(avail)} available"
    if m.get("cgroup_limit"):
        detail += f", cgroup limit {_gib(m['cgroup_limit'])}"
    budget = min(x for x in (avail, m.get("cgroup_limit")) if x) if (avail or m.get("cgroup_limit")) \
        else total
    st, fix = OK, None
    if budget and budget < 2 << 30:
        st, fix = WARN, "under 2 GiB free: use the smallest model and --kv-cache-memory 256MiB"
    return [Check("memory", st, detail, fix)]


def check_disk() -> list[Check]:
    from tianxia.loader.hub import tianxia_home

    home = tianxia_home()
    probe = home
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    writable = os.access(probe, os.W_OK)
    st = OK if writable and free > 1 << 30 else WARN
    fix = None
    if not writable:
        fix = f"make {probe} writable or set TIANXIA_HOME to a writable directory"
    elif free <= 1 << 30:
        fix = "free some disk space (models need 0.1-1 GB each)"
    return [Check("TIANXIA_HOME", st, f"{home} ({_gib(free)} free"
                  f"{'' if writable else ', not writable'})", fix)]


def check_models() -> list[Check]:
    from tianxia.loader.hub import list_pulled

    pulled = list_pulled()
    if not pulled:
        return [Check("models", WARN, "none pulled", "tianxia pull smollm2-135m")]
    names = ", ".join(getattr(p, "name", str(p)) for p in pulled)
    return [Check("models", OK, f"pulled: {names}")]


def check_torch() -> list[Check]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return [Check("torch", FAIL, f"cannot import torch: {e}",
                      "pip install 'torch>=2.4' (CPU: --index-url https://download.pytorch.org/whl/cpu)")]
    checks = []
    build = "CUDA " + torch.version.cuda if torch.version.cuda else \
        ("ROCm " + torch.version.hip if getattr(torch.version, "hip", None) else "CPU-only")
    cap = None
    with contextlib.suppress(Exception):  # older torch has no get_cpu_capability
        cap = torch.backends.cpu.get_cpu_capability()
    st = OK
    fix = None
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 4):
        st, fix = FAIL, "tianxia needs torch>=2.4"
    checks.append(Check("torch", st, f"{torch.__version__} ({build} build"
                        + (f", CPU kernels: {cap}" if cap else "") + ")", fix))
    backends = []
    if torch.backends.mkldnn.is_available():
        backends.append("oneDNN")
    if getattr(torch.backends, "mkl", None) and torch.backends.mkl.is_available():
        backends.append("MKL")
    if torch.backends.openmp.is_available():
        backends.append("OpenMP")
    checks.append(Check("torch cpu libs", OK if backends else WARN, ", ".join(backends) or "none",
                        None if backends else "a torch build without OpenMP runs single-threaded"))
    # threads
    usable = usable_cores()
    quota = cgroup_cpu_limit()
    limit = min(usable, int(quota)) if quota else usable
    n = torch.get_num_threads()
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")
           if k in os.environ}
    detail = f"torch uses {n} intra-op threads, {torch.get_num_interop_threads()} inter-op; " \
             f"tianxia defaults to {usable} (-t)"
    if env:
        detail += "; " + ", ".join(f"{k}={v}" for k, v in env.items())
    st, fix = OK, None
    if n > max(1, limit):
        st, fix = WARN, f"more threads than usable cores: pass -t {max(1, limit)}"
    elif env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) < limit:
        st, fix = WARN, f"OMP_NUM_THREADS caps torch below the {limit} cores: unset it or pass -t"
    checks.append(Check("threads", st, detail, fix))
    return checks


def check_gpu() -> list[Check]:
    import torch

    checks = []
    triton = _version("triton") or _version("pytorch-triton")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            checks.append(Check(f"gpu {i}", OK, f"{p.name}, {_gib(p.total_memory)}, "
                                f"compute {p.major}.{p.minor}"))
        drv = None
        if shutil.which("nvidia-smi"):
            try:
                drv = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10, check=False).stdout.strip().splitlines()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                drv = None
        checks.append(Check("cuda", OK, f"torch CUDA {torch.version.cuda}"
                            + (f", driver {drv}" if drv else "")
                            + (f", cuDNN {torch.backends.cudnn.version()}"
                               if torch.backends.cudnn.is_available() else "")))
        checks.append(Check("triton", OK if triton else WARN, triton or "not installed",
                            None if triton else "pip install triton (matching your torch)"))
        return checks
    why = "no CUDA GPU visible"
    fix = None
    if torch.version.cuda:
        why += f" (torch is a CUDA {torch.version.cuda} build)"
        if shutil.which("nvidia-smi"):
            fix = "nvidia-smi exists but torch sees no GPU: check the driver and CUDA_VISIBLE_DEVICES"
    elif shutil.which("nvidia-smi"):
        why += " (torch is a CPU-only build)"
        fix = "install a CUDA build of torch: pip install torch --index-url " \
              "https://download.pytorch.org/whl/cu124 (pinned to your version)"
    checks.append(Check("gpu", INFO, why + "; tianxia runs on the CPU", fix))
    checks.append(Check("triton", INFO, triton or "not installed (only needed on GPU)"))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        checks.append(Check("mps", INFO, "Apple GPU present; tianxia runs on the CPU"))
    return checks


def _pkg_check(name: str, dist: str, purpose: str, fix: str, required: bool) -> Check:
    v = _version(dist)
    if v:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            return Check(dist, FAIL if required else WARN, f"{v} installed but import fails: {e}", fix)
        return Check(dist, OK, f"{v} ({purpose})")
    return Check(dist, FAIL if required else WARN, f"missing ({purpose})", fix)


def check_packages() -> list[Check]:
    req = [("transformers", "transformers", "tokenizers, GGUF vocab conversion"),
           ("tokenizers", "tokenizers", "fast tokenizers"),
           ("gguf", "gguf", "GGUF files"), ("safetensors", "safetensors", "HF weights"),
           ("jinja2", "jinja2", "chat templates"), ("numpy", "numpy", "arrays")]
    out = [_pkg_check(m, d, p, f"pip install {d}", True) for m, d, p in req]
    opt = [("fastapi", "fastapi", "tianxia serve", "pip install 'fastapi>=0.110'"),
           ("uvicorn", "uvicorn", "tianxia serve", "pip install 'uvicorn>=0.29'"),
           ("uvloop", "uvloop", "serve: the event loop in C", "pip install 'uvloop>=0.19'"),
           ("httptools", "httptools", "serve: the HTTP parser in C", "pip install 'httptools>=0.6'"),
           ("httpx", "httpx", "tianxia bench", "pip install 'httpx>=0.27'"),
           ("matplotlib", "matplotlib", "bench --plot", "pip install 'matplotlib>=3.8'"),
           ("huggingface_hub", "huggingface_hub", "Hub ids org/name", "pip install huggingface_hub")]
    out += [_pkg_check(m, d, p, f, False) for m, d, p, f in opt]
    return out


def check_features() -> list[Check]:
    """What will work, from what was found above."""
    import torch

    flags = cpu_info()["flags"]
    out = [Check("feature: run/chat", OK, "CPU inference, float32 (the CPU default)")]
    bf16_fast = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    out.append(Check("feature: --dtype bf16", OK if bf16_fast else INFO,
                     "native bf16 on this CPU" if bf16_fast else
                     "works on CPU, but without AVX-512 BF16/AMX it is emulated and slower "
                     "than float32; keep --dtype auto"))
    if torch.cuda.is_available():
        out.append(Check("feature: --device cuda", OK, "bf16 by default on GPU"))
    else:
        out.append(Check("feature: --device cuda", INFO, "unavailable (no CUDA GPU)"))
    srv_ok = all(_version(d) for d in ("fastapi", "uvicorn"))
    spec = importlib.util.find_spec("tianxia.server")
    if not srv_ok:
        out.append(Check("feature: serve", WARN, "fastapi/uvicorn missing",
                         "pip install 'fastapi>=0.110' 'uvicorn>=0.29'"))
    elif spec is None or not _has_subcommand("serve"):
        out.append(Check("feature: serve", WARN, "`tianxia serve` is not in this install",
                         "upgrade tianxia"))
    else:
        try:
            importlib.import_module("tianxia.server")
            out.append(Check("feature: serve", OK, "tianxia serve MODEL --port N (OpenAI API)"))
        except Exception as e:  # noqa: BLE001
            out.append(Check("feature: serve", WARN, f"tianxia.server fails to import: {e}",
                             "reinstall tianxia with its server dependencies"))
    out.append(Check("feature: bench", OK if _version("httpx") else WARN,
                     "tianxia bench serve|sweep|compare" if _version("httpx") else "httpx missing",
                     None if _version("httpx") else "pip install 'httpx>=0.27'"))
    plot = _version("matplotlib")
    out.append(Check("feature: bench --plot", OK if plot else WARN,
                     "PNG plots" if plot else "matplotlib missing",
                     None if plot else "pip install 'matplotlib>=3.8'"))
    return out


def _has_subcommand(name: str) -> bool:
    from tianxia.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return name in action.choices
    return False


CHECKS = [check_python, check_tianxia, check_cpu, check_memory, check_disk, check_torch,
          check_gpu, check_packages, check_models, check_features]


def run_checks() -> list[Check]:
    results: list[Check] = []
    for fn in CHECKS:
        try:
            results.extend(fn())
        except Exception as e:  # noqa: BLE001 - one broken probe must not hide the rest
            name = fn.__name__.removeprefix("check_")
            results.append(Check(name, FAIL, f"check crashed: {type(e).__name__}: {e}"))
    return results


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks()
    if getattr(args, "json", False):
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(c.line(width))
        n = {s: sum(c.status == s for c in checks) for s in (OK, INFO, WARN, FAIL)}
        print(f"\n{n[OK]} ok, {n[WARN]} warnings, {n[FAIL]} failed, {n[INFO]} info")
    if getattr(args, "strict", False) and any(c.status == FAIL for c in checks):
        return 1
    return 0


def add_doctor_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="check this machine and which tianxia features work")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 if any check failed")
    p.set_defaults(func=cmd_doctor)
    return p


if __name__ == "__main__":
    ns = argparse.Namespace(json="--json" in sys.argv, strict="--strict" in sys.argv)
    sys.exit(cmd_doctor(ns))
