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

Run as a script, not as ``-m``: it imports uvicorn, transformers and torch only, never the nexa_dagster package.
"""

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
