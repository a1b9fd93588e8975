"""The acceptance rule of a verified step.

A request with k drafts computes k + 1 rows in one step: its last token and the drafts.
Row j is sampled as plain decoding would sample the token at that position, given the
drafts before it (the same logits; a seeded draw keyed by the same position). Draft j is
kept while it equals row j's sample; the first row that disagrees gives its own sample
instead, and the rows after it are void (their inputs were wrong). When every draft is
kept, the last row's sample is one more token. The kept tokens are therefore exactly the
tokens plain decoding samples, one step at a time: for greedy requests always, for
seeded ones draw for draw, and for unseeded ones each token is drawn from the same
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], samples: Sequence[int]) -> list[int]:
    """The tokens a step yields: `samples` (one per row, len(drafts) + 1) up to and
    including the first that differs from its draft."""
    assert len(samples) == len(drafts) + 1, f"{len(samples)} samples for {len(drafts)} drafts"
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return list(samples[: j + 1])
    return list(samples)
