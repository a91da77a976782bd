"""Overlap on hivemind: DiLoCo peers as processes (tests/hivemind_peer.py) whose reduces run behind training.

A peer killed while an overlapped reduce is in flight leaves the survivors with the same global state, and a
peer restarted meanwhile joins with the state the survivors serve: the completed mean in flight included, so
it applies the same means at the same steps and averages with them from its first round.
"""

from __future__ import annotations

import os

import pytest
from peer_process import PeerProcess, exit_all
from world import FAST

pytest.importorskip("hivemind")

MODES = {
    "eager": {"overlap": "eager"},
    "streaming": {"overlap": "streaming", "fragments": 2, "overlap_steps": 1},
}


@pytest.mark.timeout(240)
# Both behind the slow marker (about 46 s each): the default run's 10 minutes. Run them with -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "streaming"])
def test_a_peer_killed_with_an_overlapped_reduce_in_flight_leaves_the_survivors_equal_and_a_restart_rejoins(
    tmp_path, mode
):
    flag = str(tmp_path / "die")
    # Peer 2 must be in the survivors' group to die in its reduce: a wider matchmaking window than FAST's keeps a
    # loaded machine (a CI run, 2 cores) from leaving it to average alone (seen once: it then never died).
    base = dict(run_id=f"overlap-{mode}", secret="o", target_group_size=3, **dict(FAST, matchmaking_time=5.0))
    diloco = MODES[mode]
    peers: list[PeerProcess] = []
    try:
        peers.append(PeerProcess(0, base, str(tmp_path / "peer0.log"), diloco=diloco))
        joined = dict(base, initial_peers=peers[0].next()["addr"])
        peers += [
            PeerProcess(1, joined, str(tmp_path / "peer1.log"), diloco=diloco),
            PeerProcess(2, joined, str(tmp_path / "peer2.log"), die_flag=flag, diloco=diloco),
        ]
        ready = [p.next() if i == 0 else (p.next(), p.next())[1] for i, p in enumerate(peers)]
        assert len({r["digest"] for r in ready}) == 1, ready

        def round_on(group):
            for p in group:
                p.send("round")
            return [p.next(90) for p in group]

        for _ in range(3):
            out = round_on(peers)
            assert all("error" not in o for o in out) and len({o["digest"] for o in out}) == 1, out
        assert {o["contributors"] for o in out} == {3}, out

        # Peer 2 dies as a reducer of the reduce that its round's last step begins (eager: its whole round's;
        # streaming: a fragment's), which runs behind the survivors' next steps.
        peers[2].send("round-die")
        out = round_on(peers[:2])
        assert out[0]["digest"] == out[1]["digest"], out
        while "exited" not in (last := peers[2].next(60)):
            assert "error" not in last, last
        for _ in range(2):  # the survivors apply the reduce they finished without it, then keep training
            out = round_on(peers[:2])
            assert all("error" not in o for o in out) and out[0]["digest"] == out[1]["digest"], out
        assert [o["contributors"] for o in out] == [2, 2], out

        os.remove(flag)
        peers[2] = PeerProcess(2, joined, str(tmp_path / "peer2b.log"), diloco=diloco)
        assert "addr" in peers[2].next()
        back = peers[2].next(90)
        assert back.get("loaded") is True and back["round"] == out[0]["round"], (back, out)
        assert back["digest"] == out[0]["digest"], (back, out)  # what the survivors hold, their mean in flight aside
        for _ in range(3):
            out = round_on(peers)
            assert all("error" not in o for o in out) and len({o["digest"] for o in out}) == 1, out
        assert {o["contributors"] for o in out} == {3}, out
        assert exit_all(peers)
    finally:
        for p in peers:
            p.kill()
