"""Every test is in exactly one tier, and the unit tier starts no process (tests/conftest.py, README "Tests")."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

from conftest import COLLECTED, UNIT_MODULES

TESTS = pathlib.Path(__file__).resolve().parent
# What starts a process or opens a socket (or a process group, which opens sockets).
SPAWNING_MODULES = (
    "subprocess",
    "multiprocessing",
    "concurrent.futures.process",
    "socket",
    "socketserver",
    "http",
    "urllib.request",
    "pty",
    "torch.distributed",
    "torch.multiprocessing",
    "hivemind",
    "transports.hivemind",
    "torch._dynamo",  # torch.compile: Inductor runs its C++ compiler in worker processes
    "torch._inductor",
)
SPAWNING_OS_CALLS = ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "kill", "killpg")


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):  # function-level imports too
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _spawning(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in SPAWNING_MODULES)


def _os_calls(tree: ast.AST) -> set[str]:
    return {
        f"os.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
        and (node.attr in SPAWNING_OS_CALLS or node.attr.startswith(("exec", "spawn")))
    }


def _what_starts_processes(module: str, seen: set[str]) -> list[str]:
    """What ``module`` (a file in tests/) and the tests/ modules it imports, transitively, use to start
    processes or open sockets."""
    seen.add(module)
    tree = ast.parse((TESTS / f"{module}.py").read_text())
    found = [f"{module}: {name}" for name in sorted(_imports(tree)) if _spawning(name)]
    found += [f"{module}: {call}" for call in sorted(_os_calls(tree))]
    for name in sorted(_imports(tree)):
        local = name.split(".")[0]
        if local not in seen and (TESTS / f"{local}.py").is_file():
            found += _what_starts_processes(local, seen)
    return found


def test_unit_modules_exist_and_import_nothing_that_starts_a_process():
    assert UNIT_MODULES, "the unit tier is empty"
    for module in sorted(UNIT_MODULES):
        assert (TESTS / f"{module}.py").is_file(), f"tests/conftest.py names {module}, which does not exist"
        found = _what_starts_processes(module, set())
        assert found == [], f"{module} is in the unit tier but starts processes or opens sockets: {found}"


def test_the_check_finds_a_process_started_through_a_helper():
    """The check above, on modules known to start processes: directly, and through tests/world.py (gloo)."""
    assert any(f.endswith(": subprocess") for f in _what_starts_processes("test_train_launch", set()))
    assert "world: multiprocessing" in _what_starts_processes("test_identity", set())
    assert any(f.endswith(": torch._dynamo.utils") for f in _what_starts_processes("test_codec_kernels", set()))
    assert "os.fork" in _os_calls(ast.parse("import os\nos.fork()"))


# Collects the whole suite (slow tests too) in a fresh interpreter and prints each test's tier markers.
_COLLECT = """
import sys
import pytest

class Tiers:
    def pytest_collection_finish(self, session):
        for item in session.items:
            tiers = [t for t in ("unit", "integration", "slow") if item.get_closest_marker(t) is not None]
            print("TIERS", item.nodeid, ",".join(tiers))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow"], plugins=[Tiers()]))
"""


def _collected_apart() -> dict[str, str]:
    """The whole suite collected in a fresh interpreter: each test's tier markers."""
    out = subprocess.run(
        [sys.executable, "-c", _COLLECT], cwd=TESTS.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line.removeprefix("TIERS ") for line in out.stdout.splitlines() if line.startswith("TIERS ")]
    # a test's id may hold spaces, its tiers do not
    return dict(line.rsplit(" ", 1) for line in lines)


def test_every_collected_test_is_in_exactly_one_tier():
    """No test outside the three tiers or in two (conftest refuses a test in two with a usage
    error, exit code 4, so this also proves the whole suite collects), and each tier holds tests.
    Where this session collected every test module (the default run: ``-m`` deselects after
    collection), its own collection is read (conftest.COLLECTED); else the suite is collected in a
    process of its own (~10 s)."""
    modules = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")}
    whole = modules <= {test.split("::")[0] for test in COLLECTED}
    tiers = dict(COLLECTED) if whole else _collected_apart()
    assert len(tiers) > 500, len(tiers)
    assert {test: t for test, t in tiers.items() if t not in ("unit", "integration", "slow")} == {}
    assert set(tiers.values()) == {"unit", "integration", "slow"}
