"""Prefect's temporary server for a local run, stopped even when the run is killed outright.

Without ``PREFECT_API_URL``, Prefect starts a temporary server (uvicorn, a child process) on
first use and stops it at exit; a flow process killed with SIGKILL (or by the OOM killer)
never reaches its exit handlers, and the server was left running for good. Here the server is
started before the flow, as the same instance Prefect's clients use (``SubprocessASGIServer``
is one per port; the default one has no port), with a reaper process beside it
(:func:`stages.common.process.reap_children_when_gone`) that stops it when this process dies,
from the moment the server process exists.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from stages.common.process import reap_children_when_gone


@contextlib.contextmanager
def temporary_server() -> Iterator[str | None]:
    """Yields the temporary server's API URL, or None when runs report to a configured server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        yield None
        return
    from prefect.server.api.server import SubprocessASGIServer

    reaper = reap_children_when_gone("prefect.server.api.server:create_app")  # before the server exists
    server = SubprocessASGIServer()  # the instance get_client() would start: it finds it running
    try:
        server.start()
        yield server.api_url
    finally:
        server.stop()
        reaper.terminate()
        reaper.wait(timeout=10)
