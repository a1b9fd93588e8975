"""Which blocks of a sliding-window KV cache group a token can see: the one rule the
scheduler's SlidingWindowManager, the NIXL connector's read plan and the offload connector
all use.

A token at position `p` in a group of window `W` attends positions `[p - W + 1, p]`, so the
first block it reads is `first_visible_block(W, B, p)`. Every later token sees no earlier
block: a block before it is dead for the request that computes `p` next.

The scheduler (`single_type_manager.SlidingWindowManager`):

- allocates, for a request given `n` tokens, the blocks from `first_allocated_block(W, B, n)`:
  those the token at the last block boundary before the last of them, `h = (n - 1) // B * B`,
  sees. `h` is where the longest prefix hit of the same tokens ends (a hit never covers the
  last token), so the blocks registered in the prefix cache make that hit usable. Since
  `h <= n - 1`, this is never after `first_visible_block(W, B, n - 1)`;
- frees, before each step, the blocks before `first_visible_block(W, B, c)`, where `c`
  tokens are computed (the step's first token is at position `c`).

P/D. The prefiller computes the whole prompt of `N` tokens; its last step computed position
`N - 1`, so when it finishes it still holds every block from `first_visible_block(W, B, N - 1)`.
The decoder loads the first `c = N - 1` tokens (the last prompt token it computes itself,
at position `N - 1`; every later token sees less), so it must read exactly the blocks from
`first_visible_block(W, B, N - 1)` up to the last one loaded: the prefiller always holds them.
The decoder's scheduler allocates from `first_allocated_block(W, B, N - 1)`, which may be one
block earlier (a boundary hit's block): nothing sends that block (the prefiller may never
have allocated it, or freed it during its last chunk), so when the load completes the
decoder lets go of the blocks before `first_visible_block(W, B, c)` before it registers the
loaded blocks in its prefix cache (`KVCacheManager.cache_loaded_blocks`). A block it holds
but did not receive is therefore never offered as a prefix hit; the cost is that a later
prefix hit ending at the loaded prompt's last block boundary finds no window there (the
sliding group's hit, and so the request's, is shorter), never stale KV.

The offload connector loads, for a hit ending at block `e`, the blocks from
`first_visible_block(W, B, e * B)` and offers the hit only where the scheduler allocates them
(`first_allocated_block` of the request's tokens is not after that block).
"""

from __future__ import annotations


def first_visible_block(window: int, block_size: int, position: int) -> int:
    """The first block the token at `position` attends (its window's first position's)."""
    return max(0, position - window + 1) // block_size


def first_allocated_block(window: int, block_size: int, num_tokens: int) -> int:
    """The first block a sliding group allocates for a request given `num_tokens` tokens:
    what the token at the last block boundary before the last of them sees."""
    boundary = (num_tokens - 1) // block_size * block_size
    return first_visible_block(window, block_size, boundary)
