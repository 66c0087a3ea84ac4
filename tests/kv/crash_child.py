"""A process that dies by SIGKILL at one step of a block write (for the crash test).

`python -m tests.kv.crash_child DIRECTORY STEP`: opens the tier, writes block "2"*64 and kills
itself when the write reaches STEP (one of blockfile.STEPS); exits 3 if it never does."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from lucia_kv.config import TierSpec
from lucia_kv.tier import Tier

from tests.kv.support import payload

NAME = "2" * 64
SIZE = 20_000


def main() -> None:
    directory, step = Path(sys.argv[1]), sys.argv[2]

    def die_at(now: str) -> None:
        if now == step:
            os.kill(os.getpid(), signal.SIGKILL)

    tier = Tier(TierSpec("hdd", directory, 1 << 20), fault=die_at)
    tier.rebuild(100, 10.0)
    tier.write(NAME, payload(2, SIZE))
    sys.exit(3)


if __name__ == "__main__":
    main()
