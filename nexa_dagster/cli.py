"""``nexa-dagster``: everyday operations outside the UI.

    nexa-dagster status      which checkpoint is in production (pointer file and MLflow alias)
    nexa-dagster rollback    make the previous production model current again
    nexa-dagster serve       serve the production model on an OpenAI-compatible endpoint until Ctrl-C
    nexa-dagster demo        the whole tiny pipeline (what `make run` runs)
"""

from __future__ import annotations

import argparse
import sys
import time


def _resources() -> tuple[object, object]:
    from nexa_dagster.definitions import build_resources

    resources = build_resources()
    return resources["storage"], resources["tracking"]


def status() -> int:
    from nexa_dagster.core.promotion import ProductionRegistry, load_policy

    storage, tracking = _resources()
    state = ProductionRegistry(storage.production_pointer()).state()
    if state.current is None:
        print("no production model yet")
        return 0
    c = state.current
    print(f"production: {c.checkpoint_id}  ({c.metric} {c.value:.4f}, promoted {c.promoted_at})")
    print(f"  path: {c.checkpoint_path}")
    alias = tracking.alias_version(load_policy().registered_model, "production")
    if alias:
        print(f"  MLflow: {load_policy().registered_model} version {alias[0]} (alias production)")
    for h in reversed(state.history):
        print(f"  before: {h.checkpoint_id} ({h.metric} {h.value:.4f}, promoted {h.promoted_at})")
    return 0


def rollback() -> int:
    from nexa_dagster.core.promotion import ProductionRegistry, load_policy

    storage, tracking = _resources()
    registry = ProductionRegistry(storage.production_pointer())
    before = registry.current()
    state = registry.rollback()
    assert state.current is not None
    policy = load_policy()
    version = state.current.mlflow_version or tracking.version_of(policy.registered_model,
                                                                  state.current.checkpoint_id)
    if version:
        tracking.set_alias(policy.registered_model, "production", version)
    print(f"rolled back: production is {state.current.checkpoint_id} again "
          f"(was {before.checkpoint_id if before else 'none'})")
    return 0


def serve(port: int) -> int:
    from nexa_dagster.core.llm.managed_server import ManagedServer
    from nexa_dagster.core.promotion import ProductionRegistry

    storage, _ = _resources()
    current = ProductionRegistry(storage.production_pointer()).current()
    if current is None:
        print("no production model yet: run `make run` (or let the pipeline promote one) first", file=sys.stderr)
        return 1
    with ManagedServer(current.checkpoint_path, storage.path("serving", "logs"), port=port) as server:
        print(f"serving production model {current.checkpoint_id} ({server.engine}) at {server.base_url}")
        print(f"  model name for requests: {server.model_name}", flush=True)
        print(f"  try: curl {server.base_url}/chat/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{server.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'")
        print("Ctrl-C stops it.", flush=True)
        try:
            while server.process is not None and server.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nexa-dagster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status")
    sub.add_parser("rollback")
    p_serve = sub.add_parser("serve")
    p_serve.add_argument("--port", type=int, default=8000)
    sub.add_parser("demo")
    args = parser.parse_args(argv)
    if args.command == "status":
        return status()
    if args.command == "rollback":
        return rollback()
    if args.command == "serve":
        return serve(args.port)
    from nexa_dagster.demo import main as demo

    return demo()


if __name__ == "__main__":
    sys.exit(main())
