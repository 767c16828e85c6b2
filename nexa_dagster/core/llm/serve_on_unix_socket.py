"""Run ``transformers serve`` on a Unix socket instead of a TCP port: ``python serve_on_unix_socket.py <socket>
<transformers serve arguments...>``.

Why: ``transformers serve`` has no API key and binds a TCP port, which any process of the host could reach around
the serving endpoint's key check. On a Unix socket in a folder only the service's user may enter
(``access.private_dir``), only HAProxy (and that user) reaches the engine. ``transformers serve`` builds its server
with ``uvicorn.Config(app, host=..., port=...)``; this script hands uvicorn the socket instead (``uds=``, which
uvicorn supports), then runs the transformers CLI as is. A transformers that builds its server otherwise leaves no
socket: the service then fails the engine's start with its log, never serves on a port.

Run as a script, not as ``-m``: it imports uvicorn and transformers only, never the nexa_dagster package.
"""

import sys

import uvicorn


def main() -> None:
    socket_path, argv = sys.argv[1], sys.argv[2:]
    base = uvicorn.Config

    class OnSocket(base):  # type: ignore[misc, valid-type]
        def __init__(self, app: object, **kwargs: object) -> None:
            kwargs.pop("host", None)
            kwargs.pop("port", None)
            super().__init__(app, uds=socket_path, **kwargs)

    uvicorn.Config = OnSocket  # type: ignore[misc]
    # after the patch above: the CLI binds uvicorn.Config when it loads
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", *argv]
    transformers_cli()


if __name__ == "__main__":
    main()
