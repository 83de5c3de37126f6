"""A small LRU cache keyed by object identity (for unhashable frozen models and graphs).

Keys keep strong references to their objects, so an ``id`` is never reused while cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    def __init__(self, maxsize: int = 128) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[tuple[Hashable, ...], tuple[tuple[Any, ...], V]] = OrderedDict()

    def get(self, objects: tuple[Any, ...], extra: tuple[Hashable, ...], build: Callable[[], V]) -> V:
        key = tuple(id(o) for o in objects) + extra
        hit = self._data.get(key)
        if hit is not None:
            self._data.move_to_end(key)
            return hit[1]
        value = build()
        self._data[key] = (objects, value)
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)
        return value
