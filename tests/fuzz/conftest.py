"""The fuzz suite's Hypothesis profile "lucia-fuzz": registered here, applied per test with
`settings.get_profile("lucia-fuzz")`, never loaded globally (other suites keep the defaults).

It is derandomized: every CI run replays the same examples, so a red build means the code changed,
never that the dice found something new that day, and a failure reruns identically. To explore new
examples (locally, or in a nightly job) set LUCIA_FUZZ_EXPLORE=1: random seeds and the example
database. LUCIA_FUZZ_SCALE multiplies every example count (e.g. 0.1 for a quick local run, 10 for
a long one); tests that run fewer examples than the profile take a fraction of its max_examples.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

_EXPLORE = os.environ.get("LUCIA_FUZZ_EXPLORE", "") not in ("", "0")
_SCALE = float(os.environ.get("LUCIA_FUZZ_SCALE", "1"))

_extra: dict[str, Any] = {} if _EXPLORE else {"derandomize": True, "database": None}
settings.register_profile(
    "lucia-fuzz",
    max_examples=max(100, round(10_000 * _SCALE)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    **_extra,
)
