"""Scheduler and KV cache manager: pure CPU code, testable without a model.

- request.py: Request (tokens, progress, status, block hashes) and RequestStatus
- hashing.py: chained block hashes (sha256 over msgpack) and the incremental BlockHasher
- block_pool.py: KVCacheBlock, the LRU free queue, the BlockPool (refs, prefix cache, collision check)
- single_type_manager.py: per-group block tables (full attention, sliding window)
- kv_cache_manager.py: KVCacheManager: prefix hits, allocate_slots, caching and freeing over all groups
- step_plan.py: what one schedule() call decided, turned into a SchedulerOutput
- stop.py: stop checks on sampled tokens (EOS, stop token ids, max_tokens, context)
- interfaces.py: the protocol a connector's scheduler half satisfies
- scheduler.py: Scheduler: token budget, admission, preemption, results, connector seam
- output.py: SchedulerOutput and the per-request data handed to workers
"""
