"""The join command a hivemind peer prints, built from its effective config (issue 32, friction 2), and the
secret a resumed peer keeps. In-process: a stand-in for the transport, no swarm."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from joinable_peer import JoinablePeer

pytestmark = pytest.mark.timeout(60)

ADDRESS = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWQm"
FIRST = [  # docs/wan.md's first peer, with a few settings of a small run
    "transport.kind=hivemind",
    'transport.run_id="my-run"',
    'transport.host_maddrs=["/ip4/0.0.0.0/tcp/31337"]',
    'transport.announce_maddrs=["/ip4/203.0.113.7/tcp/31337"]',
    "transport.target_group_size=4",
    "diloco.codec=fp16",
    "train.shard=0",
    "train.num_shards=4",
    "train.steps=80",
    "model.num_layers=1",
]


def _peer() -> JoinablePeer:
    return JoinablePeer(ADDRESS)  # no generated secret


def _printed_join(capsys) -> list[str]:
    lines = [line.strip() for line in capsys.readouterr().err.splitlines() if "transport.initial_peers=" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def _config_of(argv: list[str]):
    """The config `diloco train` builds from ``argv`` (``diloco train ...`` as printed), as the CLI parses it."""
    from diloco_train.cli.main import _parser
    from diloco_train.run_config import build_config

    assert argv[:2] == ["diloco", "train"], argv
    args = _parser().parse_args(argv[1:])
    assert not args.resume and not args.config, argv
    return args, build_config((), args.overrides)


def test_a_resumed_first_peer_prints_a_join_command_with_the_runs_effective_settings(tmp_path: Path, capsys) -> None:
    """Before: the command was the resumed peer's argv rewritten (`diloco train --resume --name wan`), with no
    transport.kind, train.num_shards nor train.steps: the joiner failed with `shard=1 is invalid: expected
    below num_shards=0` (or ran another transport). Now the joiner's config is the run's, but for what a joiner
    changes: its shard, name, addresses and the peers it joins."""
    from diloco_train.run_config import build_config, load_toml
    from diloco_train.runs.join import print_join
    from diloco_train.runs.resume import write_config
    from diloco_train.runs.resume_merge import merge_onto_saved
    from transports import transport_spec

    started = build_config((), FIRST)
    run_dir = tmp_path / "runs" / "wan"
    run_dir.mkdir(parents=True)
    write_config(run_dir, started, secret_keys={"secret"})  # what the first start saved
    resumed, _ = merge_onto_saved(load_toml(run_dir / "config.toml"), files=(), overrides=(), force=False)
    command = ["diloco", "train", "--resume", "--name", "wan"]
    print_join(_peer(), spec=transport_spec(resumed.transport), config=resumed, command=command, run_dir=run_dir)
    args, joiner = _config_of(_printed_join(capsys))
    assert args.name == "wan-shard1" and joiner.train.shard == 1
    assert joiner.train.num_shards == 4 and joiner.train.steps == 80 and joiner.transport["kind"] == "hivemind"
    assert joiner.transport["initial_peers"] == [ADDRESS]
    assert joiner.transport["host_maddrs"] == ["/ip4/0.0.0.0/tcp/0"] and joiner.transport["announce_maddrs"] == []
    rewritten = {"shard", "initial_peers", "host_maddrs", "announce_maddrs"}
    mine, theirs = started.to_dict(), joiner.to_dict()
    for section in mine:
        same = {k: v for k, v in mine[section].items() if k not in rewritten}
        assert same == {k: v for k, v in theirs[section].items() if k not in rewritten}, section


def test_a_join_command_needs_no_config_file_of_this_machine(tmp_path: Path, capsys) -> None:
    """A peer started with --config: the settings of its file are in the command (the other machine has no
    such file); a secret given in the file is not (the file it is written to is named)."""
    from diloco_train.run_config import build_config
    from diloco_train.runs.join import print_join
    from diloco_train.runs.run_folder import RunFolder
    from transports import transport_spec

    toml = tmp_path / "wan.toml"
    secret = "a-secret-from-the-config-file-never-shown"
    toml.write_text(f'[train]\nsteps = 70\nnum_shards = 3\n[transport]\nkind = "hivemind"\nsecret = "{secret}"\n')
    config = build_config([toml], ["train.shard=2"])
    command = ["diloco", "train", "--config", str(toml), "--name", "wan", "--set", "train.shard=2"]
    spec = transport_spec(config.transport)
    print_join(_peer(), spec=spec, config=config, command=command, run_dir=tmp_path)
    argv = _printed_join(capsys)
    assert secret not in " ".join(argv)
    _, joiner = _config_of(argv)
    assert joiner.train.shard == 0 and joiner.train.steps == 70 and joiner.train.num_shards == 3
    assert joiner.transport["secret_file"] == str(RunFolder(tmp_path).join_secret.resolve())


def test_a_resumed_peer_keeps_the_secret_its_run_stored(tmp_path: Path, capsys) -> None:
    """A first peer that generated its secret (or was given it on its command line) stored it in join.secret;
    `--resume` as the interrupted line prints it (no secret) reads that file, and says so. Before: it generated
    a new secret, and the run's other peers could no longer meet it; nothing said so."""
    from diloco_train.run_config import build_config
    from diloco_train.runs.join import stored_secret, write_secret
    from diloco_train.runs.run_folder import RunFolder

    config = build_config((), ["transport.kind=hivemind"])
    assert stored_secret(config, tmp_path) == config  # nothing stored: a first start generates one
    path = write_secret(RunFolder(tmp_path).join_secret, "the-run-s-generated-secret-0123456789")
    resumed = stored_secret(config, tmp_path)
    assert resumed.transport["secret_file"] == str(path)
    assert f"the run's secret is read from {RunFolder(tmp_path).join_secret}" in capsys.readouterr().err
    named = build_config((), ["transport.kind=hivemind", "transport.secret_env=DILOCO_SECRET"])
    assert stored_secret(named, tmp_path) == named  # a secret the resume names wins
    inprocess = build_config()
    assert stored_secret(inprocess, tmp_path) == inprocess


def test_the_join_command_reads_back_every_kind_of_value(tmp_path: Path, capsys) -> None:
    """Strings, floats, booleans and lists go through --set's TOML reading unchanged."""
    from diloco_train.run_config import build_config
    from diloco_train.runs.join import join_command
    from transports import transport_spec

    sets = ["transport.kind=hivemind", 'data.path="my corpus.txt"', "train.lr=3e-4", "train.bf16=false"]
    sets += ["train.speeds=[1.0, 0.5]", "transport.matchmaking_time=2.5", "train.num_shards=2"]
    config = build_config((), sets)
    argv = join_command(config, spec=transport_spec(config.transport), run_name="r", addresses=[ADDRESS])
    _, joiner = _config_of(json.loads(json.dumps(argv)))
    assert joiner.data.path == "my corpus.txt" and joiner.train.lr == 3e-4 and joiner.train.bf16 is False
    assert joiner.train.speeds == config.train.speeds and joiner.transport["matchmaking_time"] == 2.5


def test_a_joiner_that_comes_late_in_the_swarms_first_round_waits_for_it() -> None:
    """Issue 32, friction 3, at the presence level: the swarm's first peer has been in the reduce of its first
    round (no round committed yet) for longer than matchmaking_time; alone, it closes that round at twice that.
    Before: the joiner started at once from the state before that round, missed it, and its first round met
    the next one a round behind: an ERROR with a traceback on both peers, ~30 state downloads, a dropped round
    (a join line pasted ~30 s after the start, as docs/wan.md says). Now it waits for that round's commit.
    Earlier in that reduce, or while the swarm is still in its first inner steps, it starts at once (it may
    make that round: tests/test_hivemind_auth.py's joiner does)."""
    pytest.importorskip("hivemind")
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from transports.hivemind.swarm import Swarm

    swarm = Swarm(resources=SimpleNamespace(config=SimpleNamespace(matchmaking_time=1.0), closed=False), key="k")
    first = {"round": 0, "joining": False, "committed_at": None, "busy": True, "since": get_dht_time() - 5.0}
    reads = []

    def others(timeout: float) -> dict:
        reads.append(timeout)
        value = {**first, "round": 1, "committed_at": 1.0, "busy": False} if len(reads) >= 3 else first
        return {b"first": SimpleNamespace(value=value, expiration_time=float("inf"))}

    swarm.others = others
    assert swarm.wait_for_round(0, timeout=30.0, stop=lambda: False) is True
    assert len(reads) == 3  # it waited for the commit
    for early in ({**first, "since": get_dht_time()}, {**first, "busy": False}):
        swarm.others = lambda timeout, v=early: {b"first": SimpleNamespace(value=v, expiration_time=float("inf"))}
        assert swarm.wait_for_round(0, timeout=30.0, stop=lambda: False) is False


def test_a_resync_downloads_again_only_once_the_round_it_waits_for_committed() -> None:
    """A peer behind its group waits for the state of the round the group is finishing. Before: it downloaded
    the whole state every second meanwhile (~30 "Downloading parameters" lines at a join); now once, then
    again when the presence says a peer committed that round."""
    pytest.importorskip("hivemind")
    import threading
    from types import SimpleNamespace

    from transports.hivemind.donor_choice import Offer
    from transports.hivemind.state_server import StateServer

    server = StateServer(joining=True, resources=SimpleNamespace(closed=False), lock=threading.RLock(), tags=dict)
    now = ({"tag": [1, b"t1"], "prev_tag": [0, b"t0"]}, [])
    successor = ({"tag": [2, b"t2"], "prev_tag": [1, b"t1"]}, [])
    polls, downloads = [], []

    def ready() -> bool:
        polls.append(1)
        return len(polls) >= 3

    def take(*, timeout: float, accept, floor: int):  # one look at the donors: one of them serves ``got``
        downloads.append(timeout)
        got = successor if len(polls) >= 3 else now
        offer = Offer(peer=b"donor", tag=tuple(got[0]["tag"]), prev=tuple(got[0]["prev_tag"]))
        return got if accept(offer) else None

    server.take = take
    assert server.download_successor((1, b"t1"), 30.0, stop=lambda: False, ready=ready) is successor
    assert len(downloads) == 2 and len(polls) == 3


def test_a_stale_state_verdict_is_no_error_with_a_traceback_in_hiveminds_log() -> None:
    """hivemind logs an exception that ends an averaging step as an ERROR with its traceback; a group whose state
    tags differ is handled by the transport (warnings on each side), so that record is dropped, as is the
    one for a step that found no group; a failed download from a donor that left is a WARNING line (hivemind
    tries the next donor). Other errors still show."""
    pytest.importorskip("hivemind")
    import logging

    from transports.hivemind.quiet_logs import quiet_hivemind_records
    from transports.hivemind.state_tag import Stale, StaleStateError, StaleVerdict

    def record(error: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "hivemind.averaging.averager", logging.ERROR, "", 0, error, None, (type(error), error, None)
        )

    verdict = StaleVerdict(kind=Stale.BEHIND, group_tag=(1, b"g"), own_tag=(0, b"o"), stale=1)
    assert not quiet_hivemind_records(record(StaleStateError(verdict)))
    assert quiet_hivemind_records(record(RuntimeError("a bug")))
    # A groupmate stopped mid-round (seen: the first peer's Ctrl+C in docs/wan.md's sequence): hivemind logs the
    # uncommitted round twice, as raised and as wrapped; the transport's own warning says it retries.
    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.averaging.matchmaking import MatchmakingException

    broken = "round not committed: partial all-reduce: reducer Qm failed: sent 0 parts, expected 1"
    assert not quiet_hivemind_records(record(AllreduceException(broken)))
    assert not quiet_hivemind_records(record(MatchmakingException(f"Unable to run All-Reduce: {broken}")))
    # A donor that left (seen: a restarted first peer's old record): one WARNING line, without the traceback.
    donor = record(RuntimeError("ControlFailure('Connect failed. msg=routing: not found')"))
    donor.funcName = "_load_state_from_peers"
    assert quiet_hivemind_records(donor) and donor.levelno == logging.WARNING and donor.exc_info is None
    # A DHT request whose sender exited before the DHT read it (seen in CI: a peer's Ctrl+C in a round; the
    # request's future is a connection its sender hands over): one WARNING line that says so.
    lost = logging.LogRecord(
        "hivemind.dht.dht", logging.ERROR, "", 0, FileNotFoundError(2, "No such file or directory"), None, None
    )
    lost.exc_info, lost.funcName = (FileNotFoundError, lost.msg, None), "_run"
    assert quiet_hivemind_records(lost) and lost.levelno == logging.WARNING and lost.exc_info is None
    assert lost.getMessage().startswith("a DHT request was lost: its sender exited before it was read")
    other = record(FileNotFoundError(2, "No such file or directory"))  # the same error anywhere else: shown
    assert quiet_hivemind_records(other) and other.levelno == logging.ERROR
