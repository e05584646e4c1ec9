"""The host tier's replacement policies on small fixed traces, computed by hand (minikv.tiers.policies)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.errors import ConfigError
from minikv.tiers import ARC, LRU, POLICIES, SeenTwice, make_policy


def replay(policy, trace: str) -> tuple[str, list]:
    """Hits as 'H'/'.' and the keys evicted at each miss ('' on a hit or when nothing left)."""
    hits, evicted = "", []
    for key in trace:
        if policy.access(key):
            hits += "H"
            evicted.append("")
        else:
            hits += "."
            evicted.append("".join(policy.insert(key) or []))
        policy.check()
    return hits, evicted


def test_lru_on_a_hand_computed_trace():
    # c = 3, trace A B C A D B E A (LRU order, least recent first):
    #   A miss [A]; B miss [A B]; C miss [A B C]; A hit [B C A]; D miss, evicts B [C A D];
    #   B miss, evicts C [A D B]; E miss, evicts A [D B E]; A miss, evicts D [B E A]
    hits, evicted = replay(LRU(3), "ABCADBEA")
    assert hits == "...H...."
    assert evicted == ["", "", "", "", "B", "C", "A", "D"]


def test_arc_on_a_hand_computed_trace_adapts_p_both_ways():
    # c = 2; state T1 | T2 | B1 | B2 (each LRU end first) and p, by Fig. 4 of Megiddo & Modha (FAST 2003).
    #  1 A  IV: |L1|=0, |L1|+|L2|=0 < c: no REPLACE. T1=[A]                                   p=0
    #  2 B  IV: |L1|=1 < c, total 1 < c.                  T1=[A B]                           p=0
    #  3 A  I : hit, A to T2.                             T1=[B] T2=[A]                      p=0
    #  4 C  IV: |L1|=1 < c, total 2 >= c, not 2c: REPLACE: |T1|=1 > p=0, B -> B1.
    #           T1=[C] T2=[A] B1=[B]                                                        p=0, evicts B
    #  5 B  II: |B1|=1 >= |B2|=0, d=1, p=1. REPLACE: |T1|=1 not > 1, A (T2's LRU) -> B2; B to T2.
    #           T1=[C] T2=[B] B2=[A]                                                        p=1, evicts A
    #  6 A  III: |B2|=1 >= |B1|=0, d=1, p=0. REPLACE(x in B2): |T1|=1 > 0, C -> B1; A to T2.
    #           T2=[B A] B1=[C]                                                             p=0, evicts C
    #  7 B  I : hit.                                      T2=[A B] B1=[C]                    p=0
    #  8 D  IV: |L1|=1 < c, total 3 >= c, not 2c: REPLACE: T1 empty, A -> B2.
    #           T1=[D] T2=[B] B1=[C] B2=[A]                                                 p=0, evicts A
    #  9 C  II: |B1|=1 >= |B2|=1, d=1, p=1. REPLACE: |T1|=1 not > 1, B -> B2; C to T2.
    #           T1=[D] T2=[C] B2=[A B]                                                      p=1, evicts B
    # 10 E  IV: |L1|=1 < c, total 4 = 2c: drop A from B2. REPLACE: |T1|=1 not > 1, C -> B2.
    #           T1=[D E] B2=[B C]                                                           p=1, evicts C
    # 11 B  III: |B2|=2 >= |B1|=0, d=1, p=0. REPLACE(x in B2): |T1|=2 > 0, D -> B1; B to T2.
    #           T1=[E] T2=[B] B1=[D] B2=[C]                                                 p=0, evicts D
    # 12 C  III: |B2|=1 >= |B1|=1, d=1, p=max(-1,0)=0. REPLACE(x in B2): |T1|=1 > 0, E -> B1.
    #           T2=[B C] B1=[D E]                                                           p=0, evicts E
    # 13 F  IV: |L1|=|B1|=2 = c, |T1|=0 < c: drop D from B1. REPLACE: T1 empty, B -> B2.
    #           T1=[F] T2=[C] B1=[E] B2=[B]                                                 p=0, evicts B
    # 14 G  IV: |L1|=2 = c, |T1|=1 < c: drop E from B1. REPLACE: |T1|=1 > 0, F -> B1.
    #           T1=[G] T2=[C] B1=[F] B2=[B]                                                 p=0, evicts F
    # 15 F  II: |B1|=1 >= |B2|=1, d=1, p=1. REPLACE: |T1|=1 not > 1, C -> B2; F to T2.
    #           T1=[G] T2=[F] B2=[B C]                                                      p=1, evicts C
    # 16 H  IV: |L1|=1 < c, total 4 = 2c: drop B from B2. REPLACE: |T1|=1 not > 1, F -> B2.
    #           T1=[G H] B2=[C F]                                                           p=1, evicts F
    # 17 I  IV: |L1|=|T1|=2 = c and B1 empty: T1's LRU G leaves without a ghost.
    #           T1=[H I] B2=[C F]                                                           p=1, evicts G
    arc = ARC(2)
    ps = []
    hits, evicted = "", []
    for key in "ABACBABDCEBCFGFHI":
        h, ev = replay(arc, key)
        hits, evicted = hits + h, evicted + ev
        ps.append(arc.p)
    assert hits == "..H...H.........."
    assert evicted == ["", "", "", "B", "A", "C", "", "A", "B", "C", "D", "E", "B", "F", "C", "F", "G"]
    assert ps == [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2)) == (["H", "I"], [], [], ["C", "F"])


def test_arc_keeps_a_frequent_key_through_a_scan_where_lru_loses_it():
    # c = 2. A twice (A lands in T2), then a scan of one-shot keys B C D E, then A.
    # LRU: after A A B the list is [A B]; C evicts A, so the final A misses.
    # ARC: after A A: T2=[A]. B: T1=[B]. C: IV, |L1|=1, total 2: REPLACE |T1|=1 > p=0: B -> B1, T1=[C].
    # D: IV, |L1|=|T1|+|B1|=2 = c, |T1|=1 < c: drop B, REPLACE: C -> B1, T1=[D]. E: the same, T1=[E].
    # A is still in T2: a hit.
    assert replay(LRU(2), "AABCDEA")[0] == ".H....."
    assert replay(ARC(2), "AABCDEA")[0] == ".H....H"


def test_seen_twice_stores_nothing_on_one_shot_keys_and_a_key_on_its_second_insert():
    for inner in (LRU(4), ARC(4)):
        f = SeenTwice(inner, history=8)
        assert all(f.insert(k) is None for k in range(100))  # a stream of one-shot prompts
        assert len(f) == 0 and len(inner) == 0 and f.refused == 100
        assert f.insert(99) == [] and 99 in f  # seen before (still in the history): stored
        assert f.insert(50) is None  # forgotten: the history holds the last 8 keys only
        f.check()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 9), max_size=80))
def test_lru_hits_exactly_when_fewer_than_c_other_keys_came_since(c, trace):
    lru = LRU(c)
    for i, key in enumerate(trace):
        earlier = [j for j in range(i) if trace[j] == key]
        expected = bool(earlier) and len(set(trace[earlier[-1] + 1:i])) < c
        assert lru.request(key) == expected
        lru.check()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 12), max_size=120))
def test_arc_ghost_lists_stay_bounded_and_hits_mean_resident(c, trace):
    arc = ARC(c)
    for key in trace:
        resident = key in arc
        assert arc.request(key) == resident
        arc.check()  # |T1|+|T2| <= c, |T1|+|B1| <= c, all four <= 2c, disjoint, 0 <= p <= c
        assert key in arc


def test_make_policy_names():
    assert isinstance(make_policy("lru", 3), LRU) and type(make_policy("arc", 3)) is ARC
    f = make_policy("seen_twice_arc", 3)
    assert isinstance(f, SeenTwice) and type(f.inner) is ARC and f.capacity == 3
    assert set(POLICIES) == {"lru", "arc", "seen_twice", "seen_twice_arc"}
    with pytest.raises(ConfigError, match="policy"):
        make_policy("lfu", 3)
    with pytest.raises(ConfigError, match="capacity"):
        LRU(0)
