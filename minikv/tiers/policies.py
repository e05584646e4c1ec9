"""Replacement policies for the host tier (``minikv.tiers``): LRU, ARC, and a seen-twice admission filter.

Each policy is a small pure class over *keys* (the chain hashes of full blocks): it never sees a
block id or a K/V number, so its hit/miss sequence on a trace can be checked by hand. A policy
holds at most ``capacity`` resident keys. The tier asks it three things:

* ``access(key) -> bool``: a reference to ``key``. True (a hit) when resident; the policy updates
  its order. False changes nothing (the content is not there to insert yet).
* ``insert(key) -> list | None``: the content of ``key`` has arrived (a block was demoted); make it
  resident and return the keys evicted to make room, or None when the policy refuses to store it
  (only the admission filter refuses).
* ``remove(key)``: the key left for another reason (the tier found no host slot for it).

``request(key)`` is the textbook reference, ``access`` then ``insert`` on a miss; the tests
replay hand-computed traces through it.

ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003, Fig. 4)
-----------------------------------------------------------------------------------------
Two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two *ghost*
lists of evicted keys only, B1 (evicted from T1) and B2 (from T2). A miss that hits a ghost
list says which side was too small: a hit in B1 grows the target size ``p`` of T1, a hit in B2
shrinks it. REPLACE evicts from T1 while it is above its target, else from T2. The ghosts are
bounded: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c`` (``check`` asserts both).

Seen twice
----------
``SeenTwice(inner)`` stores a key only on its second ``insert``: the first one just remembers
the key in a bounded FIFO of ``history`` keys. A stream of one-shot prompts then stores
nothing, and a shared system prompt, demoted again after it was recomputed, gets in.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from minikv.errors import check_choice, check_int


class LRU:
    """Least recently used: evict the key whose last reference is the oldest."""

    name = "lru"

    def __init__(self, capacity: int):
        self.capacity = check_int("capacity", capacity)
        self._keys: OrderedDict = OrderedDict()  # least recently used first

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def resident(self) -> list:
        return list(self._keys)

    def access(self, key: Hashable) -> bool:
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def insert(self, key: Hashable) -> list:
        if key in self._keys:
            self._keys.move_to_end(key)
            return []
        evicted = []
        while len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return evicted

    def remove(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def request(self, key: Hashable) -> bool:
        """The textbook reference: True on a hit; on a miss the key is inserted."""
        if self.access(key):
            return True
        self.insert(key)
        return False

    def check(self) -> None:
        assert len(self._keys) <= self.capacity


class ARC(LRU):
    """Adaptive replacement (see the module docstring); ``p`` is T1's target size, 0 <= p <= c."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))  # LRU end first
        self.p = 0.0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def resident(self) -> list:
        return list(self.t1) + list(self.t2)

    def access(self, key: Hashable) -> bool:
        """Case I: a hit in T1 or T2 moves the key to T2's MRU end."""
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
            return True
        if key in self.t2:
            self.t2.move_to_end(key)
            return True
        return False

    def _replace(self, in_b2: bool) -> list:
        """REPLACE(x, p): evict T1's LRU key to B1 if T1 is over target, else T2's LRU key to B2."""
        if len(self) < self.capacity:
            return []  # room left (a key was removed from outside): nothing to evict
        if self.t1 and ((in_b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            key = self.t1.popitem(last=False)[0]
            self.b1[key] = None
        else:
            key = self.t2.popitem(last=False)[0]
            self.b2[key] = None
        return [key]

    def insert(self, key: Hashable) -> list:
        """Cases II-IV of Fig. 4 (a miss whose content has arrived)."""
        if key in self:
            self.access(key)
            return []
        c = self.capacity
        if key in self.b1:  # case II: T1 was too small
            self.p = min(self.p + (1.0 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)), c)
            evicted = self._replace(False)
            del self.b1[key]
            self.t2[key] = None
            return evicted
        if key in self.b2:  # case III: T2 was too small
            self.p = max(self.p - (1.0 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)), 0.0)
            evicted = self._replace(True)
            del self.b2[key]
            self.t2[key] = None
            return evicted
        evicted = []  # case IV: a key in no list
        if len(self.t1) + len(self.b1) == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                evicted = self._replace(False)
            else:  # B1 is empty: T1's LRU key leaves without a ghost
                evicted = [self.t1.popitem(last=False)[0]]
        elif len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) >= c:
            if len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) == 2 * c:
                self.b2.popitem(last=False)
            evicted = self._replace(False)
        self.t1[key] = None
        return evicted

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def check(self) -> None:
        c, lists = self.capacity, (self.t1, self.t2, self.b1, self.b2)
        assert len(self.t1) + len(self.t2) <= c, "more resident keys than the capacity"
        assert len(self.t1) + len(self.b1) <= c, "|T1| + |B1| > c"
        assert sum(map(len, lists)) <= 2 * c, "the four lists hold more than 2c keys"
        assert sum(map(len, lists)) == len(set().union(*lists)), "a key is in two lists"
        assert 0 <= self.p <= c


class SeenTwice:
    """An admission filter: ``inner`` stores a key only on its second ``insert`` (``history`` keys remembered)."""

    def __init__(self, inner: LRU, history: int | None = None):
        self.inner = inner
        self.capacity = inner.capacity
        self.history = check_int("history", 2 * inner.capacity if history is None else history)
        self.name = f"seen_twice({inner.name})"
        self._seen: OrderedDict = OrderedDict()  # keys inserted once, oldest first
        self.refused = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def resident(self) -> list:
        return self.inner.resident()

    def access(self, key: Hashable) -> bool:
        return self.inner.access(key)

    def insert(self, key: Hashable) -> list | None:
        if key in self.inner or key in self._seen:
            self._seen.pop(key, None)
            return self.inner.insert(key)
        self._seen[key] = None
        while len(self._seen) > self.history:
            self._seen.popitem(last=False)
        self.refused += 1
        return None

    def remove(self, key: Hashable) -> None:
        self.inner.remove(key)

    request = LRU.request  # the same textbook rule over this class's access/insert

    def check(self) -> None:
        self.inner.check()
        assert len(self._seen) <= self.history


POLICIES = ("lru", "arc", "seen_twice", "seen_twice_arc")


def make_policy(name: str, capacity: int) -> LRU | SeenTwice:
    """A policy by name: "lru", "arc", "seen_twice" (over LRU) or "seen_twice_arc"."""
    check_choice("policy", name, POLICIES)
    inner = ARC(capacity) if name.endswith("arc") else LRU(capacity)
    return SeenTwice(inner) if name.startswith("seen_twice") else inner


__all__ = ["ARC", "LRU", "POLICIES", "SeenTwice", "make_policy"]
