"""tianxia replicas on Ray Serve behind one OpenAI-compatible ingress (``pip install tianxia[ray]``).

``serve run tianxia.ray:app model=smollm2-135m num_replicas=2`` (``app`` is an application
builder: Ray passes the ``key=value`` arguments, or a config file's ``args``, as a dict).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from tianxia.ray.ingress import Ingress
from tianxia.ray.replica import TianxiaReplica, serve_args

ROUTERS = {
    "prefix": "tianxia.ray.router:PrefixAwareRequestRouter",
    "round-robin": "tianxia.ray.router:RoundRobinRequestRouter",
    # Ray's default: power of two choices over queue lengths, blind to prompts
    "pow2": "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter",
}


def _int(args: dict[str, Any], key: str, default: int | None) -> int | None:
    value = args.get(key, default)
    return None if value is None else int(value)


def app(args: dict[str, Any]) -> serve.Application:
    """The application: ``model`` (required), ``num_replicas`` (default 1), ``threads`` (CPU
    threads per replica), ``num_gpus`` (per replica), ``router`` (``prefix``, ``round-robin``
    or ``pow2``), ``max_ongoing_requests`` (a replica's queue bound, default 32), ``min_replicas`` /
    ``max_replicas`` / ``target_ongoing_requests`` (autoscaling instead of a fixed count),
    ``autoscaling_config`` (any other fields of Ray's, a dict or its JSON, e.g. the delays) and
    ``serve_args`` (any other ``tianxia serve`` flags, one string)."""
    unknown = set(args) - {
        "model", "num_replicas", "threads", "num_gpus", "router", "max_ongoing_requests",
        "min_replicas", "max_replicas", "target_ongoing_requests", "autoscaling_config",
        "serve_args",
    }
    if unknown:
        raise ValueError(f"unknown argument(s) for tianxia.ray:app: {', '.join(sorted(unknown))}")
    if "model" not in args:
        raise ValueError("tianxia.ray:app needs model=... (a model name, path or hub id)")
    router = args.get("router", "prefix")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
    flags = shlex.split(str(args.get("serve_args", "")))
    threads = _int(args, "threads", None)
    if threads:
        flags += ["--threads", str(threads)]
    parsed = serve_args(str(args["model"]), flags)  # a bad flag fails here, not in every replica
    options: dict[str, Any] = {
        "max_ongoing_requests": _int(args, "max_ongoing_requests", 32),
        "ray_actor_options": {
            "num_cpus": threads or 1,
            "num_gpus": float(args.get("num_gpus", 0)),
        },
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTERS[router],
            # the prefix tree's blocks are the replicas' KV blocks
            request_router_kwargs={"block_size": parsed.block_size} if router == "prefix" else {},
        ),
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
    }
    extra = args.get("autoscaling_config") or {}
    if isinstance(extra, str):  # `serve run ... autoscaling_config='{...}'`
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise ValueError(f"autoscaling_config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("autoscaling_config must be a mapping of Ray's autoscaling fields")
    if "max_replicas" in args or extra:
        options["autoscaling_config"] = {
            "min_replicas": _int(args, "min_replicas", 1),
            "max_replicas": _int(args, "max_replicas", 1),
            "target_ongoing_requests": float(args.get("target_ongoing_requests", 4)),
            **extra,
        }
    else:
        options["num_replicas"] = _int(args, "num_replicas", 1)
    replica = serve.deployment(TianxiaReplica, name="TianxiaReplica").options(**options)
    return Ingress.bind(replica.bind(str(args["model"]), flags), str(args["model"]), flags)
