"""moto's S3 server (as `python -m moto.server -H HOST -p PORT` runs it), with conditional writes
atomic, as S3 makes them: moto checks a PUT's `If-None-Match` / `If-Match` and then writes, with
nothing held in between, so two racing conditional PUTs of one key could both win (seen once in
the backend suite's race of 8 under load). Requests that carry a condition are serialised here.

With CLOCK_OFFSET (seconds), the server's clock, which stamps every object's Last-Modified, runs
that far from this machine's: a writer's clock and the server's need not agree.

Usage: python tests/moto_server.py HOST PORT [CLOCK_OFFSET]"""

from __future__ import annotations

import datetime
import sys
import threading
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def main(host: str, port: int, clock_offset: float = 0.0) -> None:
    if clock_offset:
        import moto.s3.models
        from moto.core.utils import utcnow

        skew = datetime.timedelta(seconds=clock_offset)
        moto.s3.models.utcnow = lambda: utcnow() + skew  # type: ignore[attr-defined]
    app = DomainDispatcherApplication(create_backend_app)
    conditional = threading.Lock()

    def serialised(environ: dict[str, Any], start_response: Any) -> Any:
        if "HTTP_IF_NONE_MATCH" not in environ and "HTTP_IF_MATCH" not in environ:
            return app(environ, start_response)
        with conditional:
            return list(app(environ, start_response))  # the whole answer while the lock is held

    run_simple(host, port, serialised, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
