"""Exponential backoff with jitter: the one formula for every retry loop in gpuvigil.

Delay before retry n (n = failures so far, from 1): base·2^(n-1), capped at `cap`, then scaled by
a factor drawn from [1 - jitter, 1] ("equal jitter" at the default 0.5). Without the jitter,
instances that failed together (several `serve` processes when Alertmanager restarts; every
pending hint when slurmctld is down) retry together, in lockstep, for ever.

With `key`, the factor is derived from the key (a hash), not drawn: a caller that asks again
and again whether a retry is due (each tick, for each stored hint) gets the same answer each time,
and different keys are spread apart. Standard library only.
"""

from __future__ import annotations

import hashlib
import random

DEFAULT_JITTER = 0.5


def _unit(key: str) -> float:
    """A number in [0, 1) fixed by `key`."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big") / 2.0**64


def backoff_seconds(failures: int, base: float, cap: float, *, jitter: float = DEFAULT_JITTER, key: str | None = None,
                    rng: random.Random | None = None) -> float:
    """Seconds to wait after `failures` consecutive failures (0 failures: no wait)."""
    if failures < 1 or base <= 0:
        return 0.0
    if not 0.0 <= jitter <= 1.0:
        raise ValueError("jitter must be within [0, 1]")
    # 2**n overflows a float past n≈1024: the cap is reached long before.
    full = min(cap, base * 2.0 ** min(failures - 1, 1000))
    u = _unit(key) if key is not None else (rng or random).random()
    return full * (1.0 - jitter * u)
