"""The messages that cross layers, in a package below all of them (no package cycles):

- engine_core: requests and outputs between the front end (API, LLM), the engine core
  and the scheduler;
- scheduler_output: what runs in one step, with its block ids and the connector's
  metadata (scheduler -> executor -> workers; connectors read it);
- model_runner: what a worker returns for one step (sampled tokens, logprobs);
- kv_connector: a connector's worker -> scheduler results (invariant 3).
"""
