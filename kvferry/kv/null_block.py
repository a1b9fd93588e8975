"""The null-block rule, stated once: an engine with a sliding-window group keeps block 0
aside as the placeholder for block-table entries that need no KV (positions the window no
longer sees); without one, every block may hold KV. The block pool, the KV cache manager,
warm-up, the offload tiers and the NIXL checks all read it from here."""

from __future__ import annotations

NULL_BLOCK_ID = 0
NO_NULL_BLOCK = -1


def reserves_null_block(has_sliding_window: bool) -> bool:
    """Whether an engine keeps the null block aside (it does exactly when a group clips to a window)."""
    return has_sliding_window


def null_block_id(has_sliding_window: bool) -> int:
    """The placeholder block's id, or NO_NULL_BLOCK when the engine reserves none."""
    return NULL_BLOCK_ID if reserves_null_block(has_sliding_window) else NO_NULL_BLOCK


def usable_block_ids(num_blocks: int, has_sliding_window: bool) -> list[int]:
    """The ids of `num_blocks` blocks that may hold KV (never the null block)."""
    null = null_block_id(has_sliding_window)
    return [b for b in range(num_blocks) if b != null]
