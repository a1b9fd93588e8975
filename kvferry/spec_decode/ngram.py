"""Prompt-lookup drafts: when the sequence's last n tokens occurred earlier in it (the
prompt or the answer so far), propose the tokens that followed them there.

Answers that quote, edit or summarize their prompt (code edits, retrieval, extraction),
and answers that fall into a loop, repeat long runs of earlier tokens; such drafts are
then often right. Matches are tried from the longest n-gram down. Of one n-gram's occurrences the latest
with `num_drafts` tokens after it wins (a loop's latest turn is the likeliest to continue
the same way), else the earliest (the most tokens after it: in a run of one repeated
token, the latest occurrence is followed by a single token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed an earlier occurrence of the longest suffix
    of `tokens` of `max_n` down to `min_n` tokens; none without a match."""
    if num_drafts < 1 or len(tokens) <= min_n:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # windows starting before the suffix itself, so a match has a next token
        windows = sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + num_drafts <= len(seq)]
            start = int(full[-1] if full.size else hits[0]) + n
            drafts: list[int] = seq[start : start + num_drafts].tolist()
            return drafts
    return []
