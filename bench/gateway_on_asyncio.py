"""`python bench/gateway_on_asyncio.py gateway ARGS...`: the gateway service on asyncio's own
event loop rather than uvloop's, the rest as `lucia-supervisor gateway` runs it (the `asyncio`
path of bench/gateway_bench.py, which measures what uvloop buys)."""

from __future__ import annotations

import sys

from supervisor.cli import main
from supervisor.host.gateway import service

if __name__ == "__main__":
    service.LOOP = None
    sys.exit(main(sys.argv[1:]))
