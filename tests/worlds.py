"""One spawned world for several checks (importable by spawned ranks).

Each spawn of rank processes costs each rank a Python start and a torch import (seconds on two
shared cores) before any work; a test file whose tests each spawn the same world size for a few
steps of independent work pays that again and again. `several` runs a list of rank functions
one after another in one world, so a module-scoped fixture can spawn once and each test assert
on its own result."""

from __future__ import annotations

from typing import Callable


def several(rank: int, world_size: int, calls: list[tuple[Callable, tuple]]) -> list:
    """[(rank function, its arguments after rank and world_size), ...] -> their results, in
    order. The functions must leave no process state behind that a later one would see (each
    builds its own run; a case that patches something restores it)."""
    return [function(rank, world_size, *args) for function, args in calls]
