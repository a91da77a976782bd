"""The utilization benchmark's arithmetic, on a hand-written metrics.jsonl (the runs themselves: bench/utilization.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from hivemind_pair import join_addresses
from utilization import command, measure, table


def _write(run_dir: Path, *, waits: dict[int, float], steps: int = 8, compute: float = 0.5) -> None:
    """``steps`` steps of ``compute`` seconds; step s also waits ``waits[s]`` seconds; a round every 4 steps."""
    run_dir.mkdir(parents=True)
    records, clock = [], 0.0
    for s in range(1, steps + 1):
        wait = waits.get(s, 0.0)
        clock += compute + wait
        if s % 4 == 0:
            records.append({"type": "round", "step": s, "bytes_sent": 1000 * s})
        sent = 1000 * s if s % 4 == 0 else 0
        records.append(
            {"type": "step", "step": s, "compute_s": compute, "comm_s": wait, "bytes_sent": sent, "time_s": clock}
        )
    records.append({"type": "summary", "step": steps, "utilization": 0.5, "bytes_sent": 12000, "eval_after": 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.timeout(30)
def test_utilization_is_compute_over_the_loops_wall_and_steady_leaves_out_the_end(tmp_path: Path) -> None:
    _write(tmp_path / "shaped-eager", waits={4: 1.0, 8: 3.0})  # 4 s of compute; 1 s waited at step 4, 3 s at the end
    r = measure(tmp_path / "shaped-eager", inner_steps=4)
    assert r is not None
    assert r["utilization"] == pytest.approx(4.0 / 8.0)
    assert r["steady_steps"] == 4 and r["steady_utilization"] == pytest.approx(2.0 / 3.0)
    assert r["syncs"] == 2 and r["peak_bytes_per_sync"] == 8000 and r["trainer_utilization"] == 0.5
    _write(tmp_path / "simulated-eager", waits={4: 0.0, 8: 1.0})
    assert measure(tmp_path / "unfinished", inner_steps=4) is None
    args = argparse.Namespace(
        rate=100.0, latency_ms=0.0, hidden=8, layers=1, intermediate=16, batch=2, inner_steps=4, wire="fp32",
        fragments=2, overlap_steps=1,
    )  # fmt: skip
    results = {
        "shaped/eager": r,
        "simulated/eager": measure(tmp_path / "simulated-eager", inner_steps=4),
    }
    text = table(results, args)
    assert "| simulated | eager | 80.0% | 50.0% | +30.0 | 100.0% | 66.7% | +33.3 |" in text


@pytest.mark.timeout(30)
def test_the_simulated_link_is_set_through_the_transport_section_and_the_shaped_one_wraps_the_command() -> None:
    args = argparse.Namespace(
        rate=100.0, latency_ms=5.0, hidden=8, layers=1, intermediate=16, batch=2, inner_steps=4, wire="fp32",
        fragments=2, overlap_steps=1, steps=8, ddp_steps=2, transport="torch", extra=["transport.background_niceness=10"],
    )  # fmt: skip
    sim = command(link="simulated-shared", mode="streaming", run_dir=Path("/x/r"), args=args)
    assert "transport.link_mbit=50" in sim and "transport.link_latency_ms=5" in sim
    assert "diloco.fragments=2" in sim and "diloco.overlap=streaming" in sim
    shaped = command(link="shaped", mode="ddp", run_dir=Path("/x/r"), args=args)
    assert shaped[0].endswith("shaped_link.sh") and shaped[1] == "100mbit" and "train.mode=ddp" in shaped
    assert not any(a.startswith("transport.link") for a in shaped) and "train.steps=2" in shaped
    args.transport = "hivemind"  # two peers under one command (in the shaped namespace alike), the joiner measured
    pair = command(link="shaped", mode="eager", run_dir=Path("/x/r"), args=args)
    assert pair[0].endswith("shaped_link.sh") and pair[3].endswith("hivemind_pair.py")
    assert pair[pair.index("--runs-dir") + 1] == "/x" and pair[pair.index("--name") + 1] == "r"
    assert "diloco.overlap=eager" in pair and not any(a.startswith(("transport.kind", "train.runs_dir")) for a in pair)
    assert pair[-1] == "transport.background_niceness=10"  # --set: after the bench's own settings


def test_the_pair_launcher_reads_the_join_command_the_first_peer_prints(tmp_path: Path) -> None:
    err = tmp_path / "first.err"
    assert join_addresses(err) is None
    err.write_text(
        "starting\n  diloco train --set 'transport.initial_peers=[\"/ip4/127.0.0.1/tcp/5/p2p/Qm\"]' --set x=1\n"
    )
    assert join_addresses(err) == ["/ip4/127.0.0.1/tcp/5/p2p/Qm"]
