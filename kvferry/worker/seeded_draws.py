"""Seeded draws keyed by position: a seeded request's uniform draw for a token is a hash of
(seed, the token's absolute position in the sequence), not the next value of a stateful
generator.

A token's draw then depends only on where the token stands, never on how the request got
there. Whatever reaches an engine as prompt + tokens so far (a request resumed after
preemption, a P/D decoder continuing the prefiller's first token, a request the proxy
continues on another decoder after its decoder died, with the sent tokens appended to
the prompt) draws, at each later position, what an undisturbed run draws, so a seeded
answer is the same token for token.

The hash is SplitMix64 jumped to the position: the key is the mixed seed, the state at
position ``p`` is ``key + p * GAMMA`` and the draw is the top 53 bits of its mix (as
Java's SplittableRandom and numpy's seeding use it). Counter-based, so a batch's draws are
a few vectorized uint64 operations, one row per request, without a per-row loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

GAMMA = np.uint64(0x9E3779B97F4A7C15)  # the golden ratio's 64-bit fraction: SplitMix64's step
MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_2 = np.uint64(0x94D049BB133111EB)
TOP_53_BITS = np.uint64(11)  # a float64 holds 53 bits of mantissa
UNIT_53 = 2.0**-53


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, element-wise on uint64 (products wrap modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * MIX_1
    z = (z ^ (z >> np.uint64(27))) * MIX_2
    mixed: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return mixed


def position_draws(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One U[0, 1) draw per (seed, position) pair: float64 [N]. Seeds are any int64 (a
    negative one is taken modulo 2**64), positions are non-negative."""
    seed_bits = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    steps = np.asarray(positions, dtype=np.uint64)
    key = _mix(seed_bits + GAMMA)
    bits = _mix(key + steps * GAMMA) >> TOP_53_BITS
    return torch.from_numpy(bits.astype(np.float64) * UNIT_53)
