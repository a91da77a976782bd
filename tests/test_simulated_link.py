"""The simulated link: reduces take bytes / bandwidth + latency on a serial link whose clock runs from the call."""

from __future__ import annotations

import re

import pytest
import torch
from threads import in_threads

from diloco_core.transport import TransportError
from transports import InProcessGroup, create_transport, transport_spec
from transports.simulated_link import SimulatedLink

N = 1000  # fp32 values per reduce: 4000 bytes sent and received in-process
BYTES = 4 * N


class FakeClock:
    """A clock that moves only when told to (or when the link sleeps on it), recording the sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _pair(*, bandwidth: float, latency: float, clocks: list[FakeClock]) -> list[SimulatedLink]:
    group = InProcessGroup(2)
    return [
        SimulatedLink(group.transport(r), bandwidth=bandwidth, latency=latency, clock=c, sleep=c.sleep)
        for r, c in enumerate(clocks)
    ]


def _both(links: list[SimulatedLink], fn) -> list:
    """Run ``fn(rank, link)`` on both ranks at once (in-process reduces need every rank to join)."""
    out: list = [None, None]

    def body(r: int) -> None:
        out[r] = fn(r, links[r])

    in_threads(body, 2, timeout=10, what="ranks")
    return out


@pytest.mark.timeout(30)
def test_a_reduce_takes_latency_plus_bytes_over_bandwidth_and_averages():
    clocks = [FakeClock(), FakeClock()]
    links = _pair(bandwidth=8 * BYTES / 2.0, latency=0.5, clocks=clocks)  # 2 s of bytes + 0.5 s latency

    def reduce(r, link):
        t = torch.full((N,), float(r))
        result = link.all_reduce([t]).wait(10)
        return result, t

    (r0, t0), (r1, t1) = _both(links, reduce)
    assert r0.seconds == pytest.approx(2.5) and r1.seconds == pytest.approx(2.5)
    assert clocks[0].sleeps == [pytest.approx(2.5)] and clocks[0].now == pytest.approx(102.5)
    assert torch.equal(t0, torch.full((N,), 0.5)) and torch.equal(t1, t0)
    assert r0.bytes_sent == BYTES and r0.num_contributors == 2


@pytest.mark.timeout(30)
def test_a_reduce_queued_behind_another_waits_for_the_link_and_time_passes_in_the_background():
    clocks = [FakeClock(), FakeClock()]
    links = _pair(bandwidth=8 * BYTES / 1.0, latency=0.25, clocks=clocks)  # 1.25 s per reduce

    def reduce(r, link):
        c = clocks[r]
        a = link.all_reduce([torch.ones(N)], key="a")
        c.now += 0.5  # the second reduce starts 0.5 s later, while the first still holds the link
        b = link.all_reduce([torch.ones(N)], key="b")
        c.now += 3.0  # the caller computes past both reduces' delivery (at +1.25 and +2.5)
        return a.wait(10), b.wait(10)

    for ra, rb in _both(links, reduce):
        assert ra.seconds == pytest.approx(1.25)
        assert rb.seconds == pytest.approx(2.0)  # starts on the link at +1.25, 0.5 s after its call
        assert rb.seconds >= 2 * 1.25 - 0.5  # not both durations from its own call: it queued behind a
    assert clocks[0].sleeps == [] and clocks[1].sleeps == []  # already delivered: waiting costs nothing


@pytest.mark.timeout(30)
def test_a_caller_that_computes_for_part_of_the_transfer_waits_only_for_the_rest():
    clocks = [FakeClock(), FakeClock()]
    links = _pair(bandwidth=8 * BYTES / 2.0, latency=0.0, clocks=clocks)

    def reduce(r, link):
        handle = link.all_reduce([torch.ones(N)])
        clocks[r].now += 1.5
        return handle.wait(10)

    for result in _both(links, reduce):
        assert result.seconds == pytest.approx(2.0)
    assert clocks[0].sleeps == [pytest.approx(0.5)] and clocks[1].sleeps == [pytest.approx(0.5)]


@pytest.mark.timeout(30)
def test_a_delivery_past_the_callers_timeout_is_a_transport_error_without_waiting_for_it():
    clocks = [FakeClock(), FakeClock()]
    links = _pair(bandwidth=8 * BYTES / 5.0, latency=0.0, clocks=clocks)  # 5 s

    def reduce(r, link):
        try:
            link.all_reduce([torch.ones(N)]).wait(2.0)
        except TransportError as e:
            return str(e)
        return None

    for message in _both(links, reduce):
        assert message is not None and "past the 2s timeout" in message
    assert clocks[0].sleeps == []


@pytest.mark.timeout(30)
def test_on_the_real_clock_the_reported_seconds_are_the_links():
    group = InProcessGroup(2)
    links = [SimulatedLink(group.transport(r), bandwidth=8 * BYTES / 0.2, latency=0.05) for r in range(2)]
    wait = 10.0
    results = _both(links, lambda r, link: link.all_reduce([torch.ones(N)]).wait(wait))
    for result in results:
        # 0.25 s of link; the in-process reduce itself is much faster; well under the wait's timeout
        assert 0.25 <= result.seconds < wait / 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"link_mbit": 0}, "link_mbit=0 is invalid: expected a finite number > 0"),
        ({"link_mbit": float("inf")}, "link_mbit=inf is invalid"),
        ({"link_mbit": "fast"}, "link_mbit='fast' is invalid"),
        ({"link_mbit": 100, "link_latency_ms": -1}, "link_latency_ms=-1 is invalid: expected a finite number >= 0"),
        ({"link_latency_ms": 10}, "link_latency_ms=10 needs link_mbit"),
    ],
)
def test_link_keys_are_validated_with_the_field_value_and_range(section, message):
    with pytest.raises(ValueError, match="^" + re.escape(f"[transport] {message}")):
        transport_spec({"kind": "inprocess", **section})


@pytest.mark.timeout(30)
def test_any_kind_takes_the_link_keys_and_is_wrapped():
    spec = transport_spec({"kind": "inprocess", "link_mbit": 80, "link_latency_ms": 20})
    links = spec.connect(2)
    assert all(isinstance(t, SimulatedLink) for t in links)
    assert links[0].bandwidth == 80e6 and links[0].latency == pytest.approx(0.02) and links[1].rank == 1
    assert spec.section["link_mbit"] == 80  # the run's config keeps it (config.toml, resume)
    assert not isinstance(transport_spec({"kind": "inprocess"}).connect(1)[0], SimulatedLink)
    wrapped = create_transport({"kind": "inprocess", "link_mbit": 1.5})
    assert isinstance(wrapped, SimulatedLink) and wrapped.bandwidth == 1.5e6
    spec = transport_spec({"kind": "torch", "link_mbit": 100, "timeout": 5})
    assert spec.link is not None and spec.link.link_mbit == 100 and spec.section["link_mbit"] == 100
    with pytest.raises(
        ValueError, match="valid keys: \\['kind', 'quorum', 'grace_seconds', 'link_latency_ms', 'link_mbit'\\]"
    ):
        transport_spec({"kind": "inprocess", "bandwidth": 1})


@pytest.mark.timeout(30)
def test_the_trainer_config_keeps_the_link_and_its_workers_sit_behind_it():
    from diloco_train.run_config import build_config

    config = build_config(overrides=["transport.link_mbit=100", "transport.link_latency_ms=5"])
    assert config.transport == {"kind": "inprocess", "link_mbit": 100, "link_latency_ms": 5}
    with pytest.raises(ValueError, match=re.escape("[transport] link_mbit=-3 is invalid")):
        build_config(overrides=["transport.link_mbit=-3"])
