"""``TransportSpec.connect``'s ``create`` (the trainer's ``train(create=...)``): a test seam that
builds a process's one transport in place of its kind's constructor (bench/insider.py builds a hivemind
insider with ``HivemindFaults`` through it); where workers are threads there is none to build."""

from __future__ import annotations

import pytest

from transports import InProcessGroup, transport_spec


def test_create_builds_the_process_s_transport_from_the_section_in_place_of_the_kind_s():
    made = []

    def create(section, *, reduce_timeout=None):
        made.append((dict(section), reduce_timeout))
        return InProcessGroup(1).transport(0)

    [transport] = transport_spec({"kind": "torch"}).connect(1, reduce_timeout=7.0, create=create)
    assert made == [({"kind": "torch"}, 7.0)] and transport.world_size == 1


def test_create_is_refused_where_workers_are_threads():
    with pytest.raises(ValueError, match="workers are threads"):
        transport_spec({"kind": "inprocess"}).connect(2, create=lambda section, **_: None)
