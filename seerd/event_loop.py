"""The event loop the daemons run on."""

from __future__ import annotations

import asyncio


def run_event_loop(main):  # noqa: ANN001, ANN201
    """Run a coroutine on uvloop when it is installed (it is, with vLLM), else on asyncio's loop:
    the coordinator's and the workers' loops share cores with the engines, and uvloop spends less
    CPU per call (`tools/bench/http_client.py`)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
