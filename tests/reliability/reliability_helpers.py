"""Constants and checks shared by the reliability tests."""

from __future__ import annotations

import httpx

API_KEY = "rel-test-key-5f1c0e"
MODEL = "smollm2-135m"
FAULTS = {
    "nan": "@@nan-fault@@",
    "detokenize": "@@detok-fault@@",
    "grammar": "@@grammar-fault@@",
}
SMALL_SLOTS, SMALL_WAITING, SMALL_TIMEOUT = 2, 4, 10
SMALL_ARGS = [
    "--api-key", API_KEY, "--kv-cache-memory", "160MiB", "--max-model-len", "3072",
    "--max-num-seqs", str(SMALL_SLOTS), "--max-waiting-requests", str(SMALL_WAITING),
    "--request-timeout", str(SMALL_TIMEOUT), "--seed", "0",
]
GUARDED_ARGS = [
    "--api-key", API_KEY, "--kv-cache-memory", "64MiB", "--max-model-len", "512",
    "--max-num-seqs", "16", "--max-waiting-requests", "512", "--request-timeout", "120",
    "--seed", "0",
]


def fault_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    faults = {**FAULTS, **(extra or {})}
    return {"TIANXIA_FAULT_INJECT": ",".join(f"{k}:{v}" for k, v in faults.items())}


def auth_client(url: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout,
                        headers={"Authorization": f"Bearer {API_KEY}"})


def assert_openai_error(resp: httpx.Response) -> dict:
    """A rejection in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"], body
    return err


def serve(args: list[str], env: dict[str, str] | None = None):
    """A fixture body: a ``tianxia serve`` process for the test, which must exit 0 on SIGTERM."""
    from tianxia.server.testing import ServerProcess

    srv = ServerProcess(args, env=env)
    srv.start()
    try:
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()[-3000:]
