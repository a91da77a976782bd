import pytest
from world import KINDS, make_world


@pytest.fixture(scope="module", params=[(k, w) for k in KINDS for w in (2, 3)], ids=lambda p: f"{p[0]}-{p[1]}")
def world(request, tmp_path_factory):
    kind, world_size = request.param
    w = make_world(kind, world_size, str(tmp_path_factory.mktemp("world")))
    yield w
    w.close()
