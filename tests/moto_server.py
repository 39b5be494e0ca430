"""moto's S3 server (as `python -m moto.server -H HOST -p PORT` runs it), with conditional writes
atomic, as S3 makes them: moto checks a PUT's `If-None-Match` / `If-Match` and then writes, with
nothing held in between, so two racing conditional PUTs of one key could both win (seen once in
the backend suite's race of 8 under load). Requests that carry a condition are serialised here.

Usage: python tests/moto_server.py HOST PORT"""

from __future__ import annotations

import sys
import threading
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def main(host: str, port: int) -> None:
    app = DomainDispatcherApplication(create_backend_app)
    conditional = threading.Lock()

    def serialised(environ: dict[str, Any], start_response: Any) -> Any:
        if "HTTP_IF_NONE_MATCH" not in environ and "HTTP_IF_MATCH" not in environ:
            return app(environ, start_response)
        with conditional:
            return list(app(environ, start_response))  # the whole answer while the lock is held

    run_simple(host, port, serialised, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
