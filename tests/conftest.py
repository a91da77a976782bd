import pytest
from world import KINDS, make_world

# hivemind at 2 peers: each of its rounds costs a matchmaking, and 3 peers are covered by tests/test_hivemind.py
WORLDS = [(k, w) for k in KINDS for w in (2, 3) if (k, w) != ("hivemind", 3)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda p: f"{p[0]}-{p[1]}")
def world(request, tmp_path_factory):
    kind, world_size = request.param
    w = make_world(kind, world_size, str(tmp_path_factory.mktemp("world")))
    yield w
    w.close()
