"""Hosts emulated on one machine, for the tests that need them (kvferry_bench.netns)."""

from kvferry_bench.netns import Hosts, unavailable

__all__ = ["Hosts", "unavailable"]
