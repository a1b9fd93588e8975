"""Structured outputs: answers constrained to a JSON schema, regex, choice or grammar
(docs/structured.md)."""
