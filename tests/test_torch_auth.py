"""The torch transport's optional secret: members average; a rank with another secret, no secret, or none of
diloco's messages is refused on every rank before anything is averaged, and no process hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import procs
import pytest
import torch

from transports import TorchDistConfig, transport_spec
from transports.torch.membership_proof import SECRET_ENV, read_secret

pytestmark = pytest.mark.timeout(180)
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
SECRET = "correct-horse-battery-staple-0123456789"
OTHER = "another-long-secret-of-a-different-run"
TIMEOUT_S = 20.0
"""Every process group's (and so the membership check's) timeout in these tests."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret_file(tmp_path, name: str, secret: str) -> str:
    path = tmp_path / name
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def _group(roles: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, str]]:
    """Start one process per (argv of tests/torch_member.py, extra environment), rank by rank, on one rendezvous;
    return each member's (exit status, output). Non-members are killed once every member has ended."""
    port = str(_free_port())
    started = []
    try:
        for rank, (args, extra) in enumerate(roles):
            env = procs.loopback_env(
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([HERE, SRC]),
                RANK=str(rank),
                WORLD_SIZE=str(len(roles)),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                **extra,
            )
            env = {k: v for k, v in env.items() if k != SECRET_ENV or k in extra}  # only where a role sets it
            cmd = [sys.executable, os.path.join(HERE, "torch_member.py"), *args]
            assert SECRET not in " ".join(cmd) and OTHER not in " ".join(cmd)
            started.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
                )
            )
        results = []
        for (args, _), proc in zip(roles, started):
            if args[0] == "member":  # bounded: the check's timeout, plus the processes' start on a loaded machine
                out, _ = proc.communicate(timeout=120)
                results.append((proc.returncode, out))
        return results
    finally:
        for proc in started:
            procs.kill_session(proc)


def _member(*secret_file: str) -> list[str]:
    return ["member", str(TIMEOUT_S), *secret_file]


def _refusals(results: list[tuple[int, str]]) -> list[str]:
    for status, out in results:
        assert status == 3 and "\naveraged " not in "\n" + out, out[-3000:]  # never reached its reduce
        assert SECRET not in out and OTHER not in out
    return [next(line for line in out.splitlines() if line.startswith("refused: ")) for _, out in results]


def test_members_with_the_same_secret_average_and_the_secret_is_in_no_argv_or_line(tmp_path):
    path = _secret_file(tmp_path, "lan.secret", SECRET)
    results = _group([(_member(path), {}), (_member(), {SECRET_ENV: SECRET}), (_member(path), {})])
    for status, out in results:
        assert status == 0, out[-3000:]
        assert "averaged 2.0" in out  # (1 + 2 + 3) / 3: every member's contribution
        assert SECRET not in out


def test_a_rank_with_another_secret_is_refused_on_every_rank_and_named(tmp_path):
    path = _secret_file(tmp_path, "lan.secret", SECRET)
    rank0, rank1, rank2 = _refusals(
        _group([(_member(path), {}), (_member(path), {}), (_member(), {SECRET_ENV: OTHER})])
    )
    for line, me in ((rank0, 0), (rank1, 1)):
        assert f"group refused by rank {me}: rank 2 did not prove the run's secret" in line
        assert "the run does not start and nothing was averaged" in line
    assert "rank 0 did not prove the run's secret" in rank2 and "rank 1 did not prove" in rank2
    assert "this rank's own secret is likely the one that differs" in rank2


def test_a_rank_without_a_secret_is_refused_and_told_how_to_set_one(tmp_path):
    rank0, rank1 = _refusals(_group([(_member(), {SECRET_ENV: SECRET}), (_member(), {})]))
    assert "group refused by rank 0: rank 1 has no secret set" in rank0
    assert "group refused by rank 1: rank 0 has a secret set, and this rank has none" in rank1
    assert f"set {SECRET_ENV} or [transport] secret_file on every rank" in rank1


# silent waits out the whole join timeout (~23 s): the slow suite runs it; junk is refused in the default run
@pytest.mark.parametrize("role", [pytest.param("silent", marks=pytest.mark.slow), "junk"])
def test_a_non_member_holding_a_rank_slot_is_refused_within_the_timeout(role):
    """A process that joined the rendezvous without diloco's check: it says nothing, or sends random bytes."""
    results = _group([(_member(), {SECRET_ENV: SECRET}), (_member(), {SECRET_ENV: SECRET}), ([role], {})])
    want = "sent nothing within 20s" if role == "silent" else "is not a diloco member"
    for line, me in zip(_refusals(results), (0, 1)):
        assert f"group refused by rank {me}: rank 2 {want}" in line, line


def test_the_secret_comes_from_the_config_a_private_file_or_the_environment(tmp_path):
    assert read_secret(secret=None, secret_file=None, environ={}) is None
    assert read_secret(secret=None, secret_file=None, environ={SECRET_ENV: SECRET}) == SECRET
    assert read_secret(secret=OTHER, secret_file=None, environ={SECRET_ENV: SECRET}) == OTHER  # the config's first
    path = _secret_file(tmp_path, "lan.secret", SECRET)
    assert read_secret(secret=None, secret_file=path, environ={SECRET_ENV: OTHER}) == SECRET
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"secret_file=.*is open to other users \(mode 640\).*chmod 600"):
        read_secret(secret=None, secret_file=path, environ={})
    with pytest.raises(ValueError, match="both set"):
        read_secret(secret=SECRET, secret_file=path, environ={})
    empty = _secret_file(tmp_path, "empty.secret", "")
    with pytest.raises(ValueError, match="is empty"):
        read_secret(secret=None, secret_file=empty, environ={})
    with pytest.raises(ValueError, match="cannot be read"):
        read_secret(secret=None, secret_file=str(tmp_path / "missing"), environ={})


def test_the_secret_is_never_shown_or_saved():
    assert SECRET not in repr(TorchDistConfig(secret=SECRET))
    with pytest.raises(ValueError, match=r"secret='' is invalid"):
        TorchDistConfig(secret="")
    assert "secret" in transport_spec({"kind": "torch", "secret": SECRET}).secret_keys  # never in config.toml


def test_a_world_of_one_needs_no_check(monkeypatch, tmp_path):
    import torch.distributed as dist

    from transports import create_transport

    monkeypatch.setenv(SECRET_ENV, SECRET)
    url = f"file://{tmp_path / 'store'}?rank=0&world_size=1"
    try:
        with create_transport({"kind": "torch", "init_method": url, "timeout": 10}) as t:
            x = [torch.ones(3)]
            assert t.all_reduce(x).wait(10).num_contributors == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
