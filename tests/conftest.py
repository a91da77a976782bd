import multiprocessing.util
import os
import shutil
import tempfile

import pytest
from world import KINDS, GlooWorld, make_world

_CHILD_TMP_KEY = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    """The suite's child processes keep their temp folders in one folder of the session's, removed at
    its end: a child killed with SIGKILL (a crash the tests stage) cannot remove the pymp-* folder
    multiprocessing made for it. This process keeps /tmp (its tmp_path's unix sockets stay short),
    and makes its own pymp-* folder now, so that the processes it forks share it (multiprocessing
    removes it when this process exits) instead of each making one."""
    tempfile.gettempdir()  # cached for this process before TMPDIR changes
    multiprocessing.util.get_temp_dir()
    children = tempfile.mkdtemp(prefix="diloco-tests-")
    config.stash[_CHILD_TMP_KEY] = (children, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = children


def pytest_unconfigure(config: pytest.Config) -> None:
    children, before = config.stash.get(_CHILD_TMP_KEY, (None, None))
    if children is None:
        return
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(children, ignore_errors=True)


# The test tiers (README "Tests"): every test is in exactly one, by its module.
# - unit: in this process only (no subprocess, no sockets, no process group, no Inductor kernels, whose C++
#   compiler runs in worker processes: test_codec_kernels, ~100 s); `python -m pytest -m unit`, < 2 min.
#   tests/test_tiers.py checks that these modules (and the tests/ helpers they import) import nothing that starts
#   a process or opens a socket.
# - integration: everything else of the default run (processes, sockets, torchrun, gloo, hivemind, compilers).
# - slow: marked `slow` by hand (long convergence or soak runs), whatever the module; `-m slow`.
UNIT_MODULES = frozenset(
    {
        "test_codec",
        "test_config_rules",
        "test_control",
        "test_directions",
        "test_diloco",
        "test_feedback",
        "test_merge",
        "test_noniid_bench",
        "test_optimizer",
        "test_overlap",
        "test_int2_codec",
        "test_sign_codec",
        "test_sparse_codec",
        "test_simulated_link",
        "test_transport_spec",
        "test_export",
        "test_train_checkpoint",
        "test_train_config",
        "test_train_data",
        "test_train_data_hf",
        "test_train_model",
        "test_inner_optimizer",
        "test_convergence_bench",
        "test_utilization_bench",
        "test_plan",
        "test_time_to_loss_bench",
        "test_train_plot",
        "test_train_sinks",
        "test_train_log",
        "test_train_report",
    }
)
TIERS = ("unit", "integration", "slow")
SLOW_VARIANTS = {
    # fixture-parametrized variants (no pytest.param to mark): each names what covers its mechanism
    "tests/test_elastic.py::test_equal_work_by_time_is_lock_step_bit_for_bit[hivemind-2-fp32]": (
        "[hivemind-2-int4]: the same peers, rounds and check on a block wire; fp32 elsewhere; ~5 s"
    ),
}
COLLECTED: dict[str, str] = {}
"""Every test this session collected (before ``-m`` or ``-k`` deselected any) and its tier: read by
tests/test_tiers.py, which collects the suite in a process of its own only where this one did
not."""


def tier_of(item: pytest.Item) -> str:
    if item.get_closest_marker("slow") is not None:
        return "slow"
    return "unit" if item.path.stem in UNIT_MODULES else "integration"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
        tier = tier_of(item)
        COLLECTED[item.nodeid] = tier
        if tier != "slow":
            item.add_marker(tier)
        marked = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if marked != [tier]:
            raise pytest.UsageError(f"{item.nodeid} is marked {marked}: a test is in exactly one tier, {tier!r} here")


# hivemind at 2 peers: each of its rounds costs a matchmaking, and 3 peers are covered by tests/test_hivemind.py
WORLDS = [(k, w) for k in KINDS for w in (2, 3) if (k, w) != ("hivemind", 3)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda p: f"{p[0]}-{p[1]}")
def world(request, tmp_path_factory):
    kind, world_size = request.param
    w = make_world(kind, world_size, str(tmp_path_factory.mktemp("world")))
    yield w
    w.close()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """Two gloo processes over 127.0.0.1, kept for a module's tests (a failed run restarts them)."""
    w = GlooWorld(2, str(tmp_path_factory.mktemp("gloo")))
    yield w
    w.close()
