"""The run's secret stays out of argv and out of every printed line (issue 29): from a file of mode 0600 or an
environment variable; the join command names it, never shows it; `ps` shows it for no process of the run."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from joinable_peer import JoinablePeer

from transports.hivemind.hivemind_config import HivemindConfig
from transports.hivemind.secret import read_secret

SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_secret_file_the_docs_write_is_one_git_ignores():
    """docs/wan.md and docs/lan.md write the secret into the checkout: `git add -A` must not take it."""
    root = SRC.parent
    ignored = [p.strip() for p in (root / ".gitignore").read_text().splitlines() if p.strip()]
    written = [
        m for doc in ("wan.md", "lan.md") for m in re.findall(r"> ([^\s)]+)\)?\n", (root / "docs" / doc).read_text())
    ]
    assert sorted(written) == ["lan.secret", "wan.secret"]
    for name in written:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in ignored), (name, ignored)


def test_the_secret_comes_from_a_private_file_or_an_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "run.secret"
    path.write_text("  a-long-enough-test-secret\n")
    path.chmod(0o600)
    assert read_secret(HivemindConfig(secret_file=str(path))) == "a-long-enough-test-secret"
    monkeypatch.setenv("DILOCO_TEST_SECRET", "from-the-environment")
    assert read_secret(HivemindConfig(secret_env="DILOCO_TEST_SECRET")) == "from-the-environment"
    assert read_secret(HivemindConfig(secret="given")) == "given"
    assert read_secret(HivemindConfig()) is None


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_secret_file_others_may_read_and_unset_sources_are_clear_errors(tmp_path, monkeypatch):
    path = tmp_path / "run.secret"
    path.write_text("a-long-enough-test-secret\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"secret_file=.* only its owner can read \(it has mode 0644: run chmod 600"):
        read_secret(HivemindConfig(secret_file=str(path)))
    path.chmod(0o640)
    with pytest.raises(ValueError, match="mode 0640"):
        read_secret(HivemindConfig(secret_file=str(path)))
    with pytest.raises(ValueError, match="secret_file=.* expected a readable file"):
        read_secret(HivemindConfig(secret_file=str(tmp_path / "none")))
    monkeypatch.delenv("DILOCO_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"secret_env='DILOCO_TEST_SECRET' is invalid.*\$DILOCO_TEST_SECRET is unset"):
        read_secret(HivemindConfig(secret_env="DILOCO_TEST_SECRET"))
    with pytest.raises(ValueError, match=r"2 set \(secret, secret_file\).*at most one"):
        HivemindConfig(secret="x", secret_file=str(path))


@pytest.mark.parametrize("given", ["generated", "argv"])
def test_the_join_command_names_a_private_file_instead_of_the_secret(tmp_path, capsys, caplog, given):
    from diloco_train.run_config import RunConfig
    from diloco_train.runs.join import print_join
    from diloco_train.runs.run_folder import RunFolder
    from transports import transport_spec

    secret = "Gen-3rated-secret-never-shown"
    section = {"kind": "hivemind"} if given == "generated" else {"kind": "hivemind", "secret": secret}
    command = ["diloco", "train", "--name", "wan", "--set", "transport.kind=hivemind"]
    if given == "argv":
        command += ["--set", f"transport.secret={json.dumps(secret)}"]
    peer = JoinablePeer("/ip4/127.0.0.1/tcp/1/p2p/Qm", generated=secret if given == "generated" else None)
    spec = transport_spec(section)
    print_join(peer, spec=spec, config=RunConfig(transport=spec.section), command=command, run_dir=tmp_path)
    printed = capsys.readouterr().err
    path = RunFolder(tmp_path).join_secret
    assert path.read_text().strip() == secret and (path.stat().st_mode & 0o777) == 0o600
    assert secret not in printed and f"transport.secret_file={json.dumps(str(path))}" in printed
    assert ("readable by every user of this machine (ps)" in caplog.text) == (given == "argv")


def _ps() -> str:
    """Every process's full command line (``-ww``: without a terminal ps cuts lines at 80 columns)."""
    return subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow  # ~11 s: a hivemind trainer; the secret's sources and the join command are checked without it above
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ps -eo args and umask as on Linux")
@pytest.mark.timeout(400)
def test_a_run_started_as_docs_wan_md_says_shows_its_secret_nowhere(tmp_path):
    """The first two commands of docs/wan.md (make the secret file, start the first peer) as written (through
    test_docs_commands' small settings, 2 peers on 127.0.0.1), then the join command the first peer printed:
    while both run, no line of `ps -eo args` (every process of the host: the peers, their DHT and averager
    processes, their p2p daemons) holds the secret, nor does any line either peer printed; both rounds
    have both peers."""
    from test_docs_commands import PRELUDE, commands

    make_secret, first_command = commands("wan.md")[1:3]  # after the pip install
    assert "wan.secret" in make_secret and "transport.secret_file" in first_command
    # Small and on 127.0.0.1; long enough a first peer that the second joins its rounds (later --set wins).
    small = ["transport.target_group_size=2", "train.num_shards=2", 'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]']
    small += ["transport.matchmaking_time=10.0", "transport.averaging_timeout=30.0", "train.steps=20"]
    small += ["diloco.inner_steps=10", "train.eval_batches=2", "model.num_layers=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}

    def start(command: str, name: str) -> subprocess.Popen:
        """``command`` (``diloco train ...``) with the small settings, its output in files (a pipe nobody reads
        would stall it)."""
        argv = shlex.split(command)
        assert argv[:2] == ["diloco", "train"], command
        argv = [sys.executable, "-m", "diloco_train.cli", *argv[1:], *(a for s in small for a in ("--set", s)), "-q"]
        out = {k: open(tmp_path / f"{name}.{k}", "w") for k in ("out", "err")}  # noqa: SIM115 - closed below
        try:
            return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out["out"], stderr=out["err"])
        finally:
            for f in out.values():
                f.close()

    made = subprocess.run(["bash", "-c", PRELUDE + make_secret], cwd=tmp_path, env=env, timeout=30, check=False)
    assert made.returncode == 0
    secret = (tmp_path / "wan.secret").read_text().strip()
    assert len(secret) >= 32 and ((tmp_path / "wan.secret").stat().st_mode & 0o777) == 0o600
    first = start(first_command, "first")
    second = None
    snapshots: list[str] = []
    try:
        deadline = time.monotonic() + 120
        join = None
        while join is None and first.poll() is None and time.monotonic() < deadline:
            lines = (tmp_path / "first.err").read_text().splitlines()
            join = next((line.strip() for line in lines if "transport.initial_peers=" in line), None)
            time.sleep(0.2)
        assert join is not None, (tmp_path / "first.err").read_text()
        second = start(join, "second")
        deadline = time.monotonic() + 240
        while second.poll() is None and time.monotonic() < deadline:  # ps while the run lasts
            snapshots.append(_ps())
            time.sleep(0.5)
        assert second.wait(timeout=1) == 0, (tmp_path / "second.err").read_text()[-3000:]
        assert first.wait(timeout=120) == 0, (tmp_path / "first.err").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    printed = [(tmp_path / f"{n}.{k}").read_text() for n in ("first", "second") for k in ("out", "err")]
    seen = "\n".join(snapshots)
    assert "p2pd" in seen and "transport.secret_file" in seen  # the snapshots saw the run's processes
    assert secret not in seen
    assert all(secret not in text for text in printed)
    rounds = [json.loads(line) for line in (tmp_path / "runs" / "wan" / "metrics.jsonl").read_text().splitlines()]
    assert 2 in [r["num_contributors"] for r in rounds if r["type"] == "round"]  # the second peer took part
