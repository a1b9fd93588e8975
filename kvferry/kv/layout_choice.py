"""Which KV layout an engine uses (invariant 5): the one every party accepts.

The parties are the KV allocator and every configured connector; each states the layouts
it accepts, in its order of preference. `--kv-layout` is the user's preference: taken when
every party accepts it, otherwise the first layout they all accept (with a warning), and
when they share none the engine refuses to start, naming who accepts what.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.errors import ConfigError
from kvferry.kv.spec import KVAllocator, Layout

logger = logging.getLogger(__name__)

# Both allocators lay tensors out in either layout (kv/allocate.py, kv/elastic.py,
# kv/elastic_cuda.py all take the shape from Layout.shape).
ALLOCATOR_LAYOUTS: dict[KVAllocator, tuple[Layout, ...]] = {
    KVAllocator.EAGER: (Layout.NHD, Layout.HND),
    KVAllocator.ELASTIC: (Layout.NHD, Layout.HND),
}


@dataclass(frozen=True)
class LayoutParty:
    """Someone who touches the KV tensors, and the layouts it accepts (preferred first)."""

    name: str
    accepts: tuple[Layout, ...]


def allocator_party(allocator: KVAllocator) -> LayoutParty:
    return LayoutParty(f"the {allocator.value} KV allocator", ALLOCATOR_LAYOUTS[allocator])


def choose_layout(preference: Layout, parties: Sequence[LayoutParty]) -> Layout:
    """The preferred layout if every party accepts it, else the first they all accept."""
    common = [layout for layout in _preference_order(parties) if all(layout in p.accepts for p in parties)]
    if not common:
        said = "; ".join(f"{p.name} accepts {_names(p.accepts)}" for p in parties)
        raise ConfigError(f"no KV layout is accepted by every party: {said}")
    if preference in common:
        return preference
    refusing = ", ".join(p.name for p in parties if preference not in p.accepts)
    logger.warning(
        "--kv-layout %s is not accepted by %s; using %s", preference.value, refusing, common[0].value
    )
    return common[0]


def _preference_order(parties: Sequence[LayoutParty]) -> list[Layout]:
    """Every layout once, in the order the parties list them (the first party's first)."""
    order = [layout for party in parties for layout in party.accepts]
    return list(dict.fromkeys(order))


def _names(layouts: tuple[Layout, ...]) -> str:
    return "/".join(layout.value for layout in layouts) if layouts else "no layout"
