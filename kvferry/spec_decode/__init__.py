"""Speculative decoding: draft tokens proposed by the scheduler, verified in one step.

`config` is --speculative-config, `ngram` proposes drafts by prompt lookup, `verify` is
the acceptance rule the model runner applies to a step's sampled tokens.
"""
