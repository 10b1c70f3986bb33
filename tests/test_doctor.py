"""``tianxia doctor``: runs, exits 0, one line per check, a fix for what is missing."""

from __future__ import annotations

import json
import subprocess
import sys

from tianxia import doctor

TIANXIA = [sys.executable, "-m", "tianxia.cli"]


def test_doctor_runs_and_prints_checks():
    r = subprocess.run(TIANXIA + ["doctor"], capture_output=True, text=True, timeout=180,
                       check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = {ln[7:].split()[0] for ln in lines if ln.startswith("[")}
    for name in ("python", "tianxia", "cpu", "cores", "memory", "torch", "threads", "TIANXIA_HOME",
                 "httpx", "feature:"):
        assert name in names, (name, r.stdout)
    for ln in lines:
        if ln.startswith("["):
            assert ln[:6] in ("[ ok ]", "[info]", "[warn]", "[FAIL]"), ln
    assert "cpu flags" in r.stdout and ("AVX2" in r.stdout or "NEON" in r.stdout
                                        or "not readable" in r.stdout)
    assert "feature: serve" in r.stdout and "feature: bench" in r.stdout
    assert lines[-1].endswith("info") and " ok, " in lines[-1]


def test_doctor_json_and_isolated_failures(monkeypatch, capsys):
    def broken():
        raise RuntimeError("probe exploded")

    def missing():
        return [doctor.Check("widget", doctor.WARN, "missing", "pip install widget")]

    monkeypatch.setattr(doctor, "CHECKS", [doctor.check_python, broken, missing, doctor.check_cpu])
    assert doctor.cmd_doctor(type("A", (), {"json": True, "strict": False})()) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert by_name["broken"]["status"] == "FAIL" and "probe exploded" in by_name["broken"]["detail"]
    assert by_name["widget"]["fix"] == "pip install widget"
    assert by_name["cores"]["status"] in ("ok", "warn")
    # the text form puts the fix on its own line; --strict turns a FAIL into exit 1
    assert doctor.cmd_doctor(type("A", (), {"json": False, "strict": True})()) == 1
    out = capsys.readouterr().out
    assert "fix: pip install widget" in out and "[FAIL] broken" in out
