"""Run ``transformers serve`` as this project's engines run it: ``python transformers_engine.py [--uds SOCKET]
[--model-process fork|spawn] [--model-threads N] serve <transformers serve arguments...>``.

``--uds``: on a Unix socket instead of a TCP port. ``transformers serve`` has no API key and binds a TCP port, which
any process of the host could reach around the serving endpoint's key check. On a Unix socket in a folder only the
service's user may enter (``access.private_dir``), only HAProxy (and that user) reaches the engine.
``transformers serve`` builds its server with ``uvicorn.Config(app, host=..., port=...)``; this script hands uvicorn
the socket instead (``uds=``, which uvicorn supports), then runs transformers' own ``serve`` command (``serve_cli``:
that command alone, not the whole CLI). A transformers that builds its server otherwise leaves no socket: the service
then fails the engine's start with its log, never serves on a port.

``--model-process``: how the model's own process starts. ``transformers serve`` (5.x) starts it with a hard-coded
``spawn``: a fresh interpreter that imports torch and transformers again, what this process has just done (~4 of
the ~10 CPU-s a tiny model's engine takes to start on a 2-core host, docs/measurements.md). ``fork`` (the default)
starts it from this process instead, where that is safe: on a CPU (``--device cpu``: no CUDA context a child could
inherit) and while this process runs one thread (the model's process is started before uvicorn's server, so a
fork copies no lock another thread holds). Otherwise, and on a transformers whose model process starts elsewhere,
transformers' own ``spawn``. Either way one line on stderr says which, and why.

``--model-threads N`` (the engine's ``OMP_NUM_THREADS``, which ``ManagedServer`` passes): the model's process,
forked, gets torch's thread pool of that size, as a spawned one reads it from the variable: an engine itself forked
from a warm Python would otherwise hand on the warm Python's single thread.

**A request's temperature decides whether it samples**, as on an OpenAI endpoint and on vLLM (``requests_decide_
sampling``): 0 is greedy, above 0 samples at it (with its ``top_p``); a request that gives none gets the model's
generation config. ``transformers serve`` 5.x takes ``do_sample`` from the model's generation config alone: on
SmolLM2-135M-Instruct (no ``do_sample``) a request at temperature 1.0 came back greedy, the same answer every time.
And with continuous batching a request can set only the sampling settings the model's generation config already
sets: on the tiny models (``do_sample``, temperature 0.8, top-p 0.95, no top-k) a greedy request, which it sends as
top-k 1, was sampled at 0.8 (six identical judge prompts at temperature 0: four to six different answers; one
without batching). Both measured 2026-12-06, transformers 5.25.0. The batching manager now starts with every
per-request setting in place (``batching_generation_config``) and each request sends all of its own
(``per_request_sampling``). A transformers laid out otherwise keeps its own behaviour, and one line says so.

Run as a script, not as ``-m``: it imports uvicorn, transformers and torch only, never the nexa_dagster package.
"""

import copy
import functools
import multiprocessing
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import uvicorn

SAID = "nexa engine: transformers serve's model process"


class ModelProcessStart:
    """``multiprocessing`` as transformers' model manager sees it: its ``get_context("spawn")`` forks while forking
    is safe (see the module's docstring), and says which it did."""

    def __init__(
        self,
        device: str,
        model_threads: int | None = None,
        threads: Callable[[], int] = threading.active_count,
    ) -> None:
        self.device, self.model_threads, self.threads = device, model_threads, threads

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)

    def get_context(self, method: str | None = None) -> Any:
        if method != "spawn":
            return multiprocessing.get_context(method)
        if self.device != "cpu":
            why = f"spawned: on {self.device or 'an unnamed device'}, transformers' own start (a fork could copy CUDA)"
        elif (threads := self.threads()) > 1:
            why = f"spawned: this process runs {threads} threads (a fork could copy a lock one of them holds)"
        else:
            _size_torch_pool(self.model_threads)
            print(f"{SAID} forked from the engine (torch and transformers imported once)", file=sys.stderr)
            return multiprocessing.get_context("fork")
        print(f"{SAID} {why}", file=sys.stderr)
        return multiprocessing.get_context("spawn")


def _size_torch_pool(threads: int | None) -> None:
    """torch's thread pool sized ``threads`` (``--model-threads``: the engine's ``OMP_NUM_THREADS``), as a fresh
    interpreter's is when it imports torch, for the model's process to inherit: an engine forked from a warm Python
    (``ManagedServer(warm=...)``) has the pool of the warm Python, which imported torch with one thread."""
    if threads:
        import torch  # imported already, with the transformers CLI

        if torch.get_num_threads() != threads:  # a cold engine's is already: left as it is
            torch.set_num_threads(threads)


def per_request_sampling(generation_kwargs: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """What a request samples with in the batching manager: greedy (top-k 1) unless it samples, and then every
    setting of its own (temperature, top-k, top-p; none given: 1.0, the whole vocabulary, 1.0, which change
    nothing), so that the manager's placeholders (``batching_generation_config``) never apply to it."""
    temperature = generation_kwargs.get("temperature")
    if not generation_kwargs.get("do_sample") or temperature == 0:
        return {"top_k": 1}
    top_k, top_p = generation_kwargs.get("top_k"), generation_kwargs.get("top_p")
    return {
        "temperature": float(1.0 if temperature is None else temperature),
        "top_k": int(top_k) if top_k else vocab_size,
        "top_p": float(1.0 if top_p is None else top_p),
    }


def batching_generation_config(model_config: Any, vocab_size: int) -> Any:
    """The model's generation config with sampling on and a temperature, a top-k and a top-p: transformers builds a
    per-request setting only where the manager's config has one (a temperature other than 1, a top-k, a top-p under
    1), so these values are placeholders: every request sends its own (``per_request_sampling``); a greedy one
    sends top-k 1, under which neither the temperature nor the top-p changes the token. The rest of the model's
    config (its suppressed tokens, say) stays."""
    config = copy.deepcopy(model_config)
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.5, vocab_size, 0.5
    return config


def requests_decide_sampling() -> None:
    """``transformers serve``'s request handling patched as the module's docstring says (in the engine, which
    builds each request's settings, and in the model's process, which batches them)."""
    try:  # in the engine after uvicorn's patch (main), as the CLI's own import; at import in a spawned model process
        from transformers.cli.serving.utils import BaseHandler, CBGenerateRunner
    except ImportError:
        BaseHandler = CBGenerateRunner = None  # noqa: N806 (the classes, when this transformers has them)
    handler = ("_build_generation_kwargs",)
    runner = ("_start_continuous_batching", "_build_continuous_batching_kwargs")
    if not (
        all(hasattr(BaseHandler, n) for n in handler) and all(hasattr(CBGenerateRunner, n) for n in runner)
    ):
        print(
            "nexa engine: requests sample as this transformers decides (not laid out as 5.x)", file=sys.stderr
        )
        return
    build_kwargs, start_batching = (
        BaseHandler._build_generation_kwargs,
        CBGenerateRunner._start_continuous_batching,
    )

    def generation_kwargs(self: Any, body: dict[str, Any], model_generation_config: Any) -> dict[str, Any]:
        kwargs = build_kwargs(self, body, model_generation_config)
        if body.get("temperature") is not None and float(body["temperature"]) > 0:
            kwargs["do_sample"] = True
        return kwargs

    def start_continuous_batching(self: Any, model: Any, cb_config: Any, context_length: int | None) -> Any:
        self.vocab_size = model.config.get_text_config().vocab_size
        config = batching_generation_config(model.generation_config, self.vocab_size)
        model.init_continuous_batching = functools.partial(
            model.init_continuous_batching, generation_config=config
        )
        try:
            return start_batching(self, model, cb_config, context_length)
        finally:
            del model.init_continuous_batching  # the instance's partial: the class's method again

    def continuous_batching_kwargs(self: Any, generation_kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "max_new_tokens": generation_kwargs["max_new_tokens"],
            "eos_token_id": generation_kwargs["eos_token_id"],
            **per_request_sampling(generation_kwargs, self.vocab_size),
        }

    BaseHandler._build_generation_kwargs = generation_kwargs
    CBGenerateRunner._start_continuous_batching = start_continuous_batching
    CBGenerateRunner._build_continuous_batching_kwargs = continuous_batching_kwargs


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def main() -> None:
    argv = sys.argv[1:]
    own: dict[str, str] = {}  # this script's options, before transformers serve's
    while argv and argv[0] in ("--uds", "--model-process", "--model-threads"):
        own[argv[0]], argv = argv[1], argv[2:]
    socket_path, model_process = own.get("--uds"), own.get("--model-process")
    if model_process not in (None, "fork", "spawn"):
        raise SystemExit(f"--model-process is fork or spawn, not {model_process!r}")
    if socket_path is not None:
        base = uvicorn.Config

        class OnSocket(base):  # type: ignore[misc, valid-type]
            def __init__(self, app: object, **kwargs: object) -> None:
                kwargs.pop("host", None)
                kwargs.pop("port", None)
                super().__init__(app, uds=socket_path, **kwargs)

        uvicorn.Config = OnSocket  # type: ignore[misc]
    # after the patch above: the CLI binds uvicorn.Config when it loads
    transformers_cli = serve_cli()

    if model_process == "spawn":
        print(f"{SAID} spawned: --model-process spawn", file=sys.stderr)
    else:
        threads = own.get("--model-threads")
        _fork_model_process(_option(argv, "--device") or "", int(threads) if threads else None)
    requests_decide_sampling()  # inherited by a forked model process; a spawned one applies it at import (below)
    sys.argv = ["transformers", *argv]
    transformers_cli()


def serve_cli() -> Callable[[], None]:
    """The ``transformers`` command with ``serve`` alone, as the full CLI registers it (``transformers.cli.
    transformers``: ``Serve`` on huggingface_hub's ``typer_factory`` group, so ``transformers serve ...`` parses as
    there). The full CLI imports every other command first, which an engine never runs: ``add-new-model-like``
    imports libcst, ``chat`` rich and markdown-it, ~0.6 of the ~2.8 CPU-s its import takes (measured 2026-12-06 on
    the 2-core Xeon), at every engine's start; and its entry asks PyPI for a newer transformers once a day, a call a
    serving engine has no business making. A transformers laid out otherwise gets its own full CLI."""
    try:  # after uvicorn's patch in main(), as the CLI's own import
        from huggingface_hub import typer_factory
        from transformers.cli.serve import Serve
    except ImportError:  # a transformers whose CLI is laid out otherwise: its own, whole
        from transformers.cli.transformers import main

        return main
    app = typer_factory(help="Transformers CLI: serve")
    app.command(name="serve")(Serve)
    return app


def _fork_model_process(device: str, model_threads: int | None) -> None:
    """Transformers' model manager given ``ModelProcessStart`` for ``multiprocessing``, where it has one."""
    try:
        from transformers.cli.serving import model_manager  # after the uvicorn patch, as the CLI's import
    except ImportError:
        model_manager = None
    if not isinstance(getattr(model_manager, "multiprocessing", None), ModuleType):
        print(f"{SAID} spawned: this transformers starts it elsewhere", file=sys.stderr)
        return
    model_manager.multiprocessing = ModelProcessStart(device, model_threads)  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
# transformers' model process, spawned (a GPU): multiprocessing imports this script as its main module there
elif __name__ == "__mp_main__":
    requests_decide_sampling()
