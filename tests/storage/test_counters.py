"""storage/api/counters.py: the one counters type (stores, encrypted levels, the vLLM tier, the SGLang backend)."""

from __future__ import annotations

import threading

import pytest

from tiered_kv.storage.api import StoreStats
from tiered_kv.storage.api.counters import Counters


def test_a_fixed_set_lists_every_name_in_order_and_refuses_others() -> None:
    c = Counters(("hits", "misses", "corrupt"))
    assert c.as_dict() == {"hits": 0, "misses": 0, "corrupt": 0}
    c.add(misses=2, hits=1)
    c.add(hits=3)
    assert list(c.as_dict().items()) == [("hits", 4), ("misses", 2), ("corrupt", 0)]
    with pytest.raises(KeyError, match="evictions"):
        c.add(evictions=1)
    assert c.take() == {"hits": 4, "misses": 2, "corrupt": 0}
    assert c.as_dict() == {"hits": 0, "misses": 0, "corrupt": 0}


def test_an_open_set_holds_only_what_moved_and_take_resets_it() -> None:
    c = Counters()
    c.add_to(("jobs", ("full",)), 0)  # a zero count creates nothing
    assert c.take() == {}
    c.add_to(("jobs", ("full",)))
    c.add_to(("jobs", ("full",)), 2)
    c.add_to(("loaded", ()), 5)
    assert c.take() == {("jobs", ("full",)): 3, ("loaded", ()): 5}
    assert c.take() == {}


def test_deltas_since_the_last_take_and_restored_when_the_write_failed() -> None:
    s = StoreStats()
    assert tuple(s.as_dict()) == StoreStats.NAMES
    s.add(hits=3, puts=1)
    assert s.take_deltas() == {"hits": 3, "misses": 0, "corrupt": 0, "evictions": 0, "puts": 1, "put_bytes": 0}
    s.add(hits=2)
    delta = s.take_deltas()
    assert delta["hits"] == 2 and delta["puts"] == 0
    s.restore_deltas(delta)  # not persisted: the next take gives it again
    s.add(misses=1)
    again = s.take_deltas()
    assert (again["hits"], again["misses"]) == (2, 1)
    assert s.as_dict()["hits"] == 5  # the counters themselves never moved back


def test_threads_adding_at_once_lose_no_count() -> None:
    c = Counters(("n",))
    series = Counters()
    start = threading.Barrier(4)

    def work() -> None:
        start.wait()
        for _ in range(10_000):
            c.add(n=1)
            series.add_to("k")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.as_dict() == {"n": 40_000} and series.take() == {"k": 40_000}
