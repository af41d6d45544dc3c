"""Wall-clock timers that wrap a function in place, for the step-breakdown experiments: every call's duration is
appended to TIMES under the wrapper's name."""

from __future__ import annotations

import time
from collections import defaultdict

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(name, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)

    return wrapper
