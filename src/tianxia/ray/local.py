"""``tianxia serve --ray-replicas N``: a local Ray instance running ``tianxia.ray:app``."""

from __future__ import annotations

import argparse
import shlex
import signal
import time

# flags the ingress, not a replica, takes (with their values)
_INGRESS_FLAGS = {"--ray-replicas", "--host", "--port"}


def replica_flags(argv: list[str], model: str | None) -> list[str]:
    """``tianxia serve``'s command line minus the subcommand, the model and the ingress's own
    flags: what each replica's engine gets."""
    out: list[str] = []
    args = list(argv[argv.index("serve") + 1:] if "serve" in argv else argv)
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in _INGRESS_FLAGS:
            skip = True
        elif a.split("=", 1)[0] in _INGRESS_FLAGS:
            pass
        elif model is not None and a == model:
            model = None  # the positional model, once
        else:
            out.append(a)
    return out


def run_local(args: argparse.Namespace, argv: list[str], default_model: str) -> int:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError("--ray-replicas needs Ray Serve: pip install 'tianxia[ray]'") from exc
    from tianxia.ray import app

    if args.ray_replicas < 1:
        raise ValueError("--ray-replicas must be at least 1")
    if args.model and len(args.model) > 1:
        raise ValueError("--ray-replicas serves one model")
    model = args.model_tag or (args.model[0] if args.model else default_model)
    flags = replica_flags(argv, args.model_tag)
    if args.model:
        flags = [f for f in flags if f != "--model" and f != args.model[0]]
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    started = time.monotonic()
    serve.run(
        app({"model": model, "num_replicas": args.ray_replicas, "threads": args.threads,
             "serve_args": shlex.join(flags)}),
        name="tianxia", route_prefix="/",
    )
    print(f"{args.ray_replicas} replica(s) of {model} ready in {time.monotonic() - started:.1f}s "
          f"on http://{args.host}:{args.port}", flush=True)
    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # a supervisor's stop shuts the replicas down too
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
