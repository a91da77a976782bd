"""``diloco plan`` and its model (``diloco_train.plan``): link seconds, bytes per sync, what each overlap mode
hides, the CLI's table and recommendation for the time-to-loss benchmark's own configurations, bad input."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from diloco_core import MergeRule, codec_for
from diloco_train.cli import main
from diloco_train.plan import Link, Method, ddp_seconds, seconds_per_round, sync_bytes
from diloco_train.routes import HIVEMIND_PHASES, route
from transports.torch.wire_bytes import GATHER_RANKS

TINY = 918_656  # the trainer's tiny model: the benchmark's (bench/time_to_loss.py)


def test_link_seconds_are_latency_plus_bytes_over_the_rate_and_a_shared_link_carries_every_worker() -> None:
    own, shared = Link(mbit=100), Link(mbit=100, shared=True)
    assert own.seconds(12.5e6, workers=2) == pytest.approx(1.0)
    assert shared.seconds(12.5e6, workers=2) == pytest.approx(2.0)
    assert Link(mbit=1000, latency_ms=20).seconds(12.5e6, workers=8) == pytest.approx(0.12)
    assert Link(mbit=0, latency_ms=5).seconds(1e12, workers=2) == pytest.approx(0.005)  # no rate limit
    # a token bucket (tc tbf) lets its burst through at once once the compute before the sync refilled it
    tbf = Link(mbit=100, shared=True, burst_bytes=512 * 1024)
    assert tbf.seconds(3.0e6, workers=2, idle_s=1.0) == pytest.approx((6.0e6 - 524_288) / 12.5e6)
    assert tbf.seconds(3.0e6, workers=2, idle_s=0.01) == pytest.approx((6.0e6 - 125_000) / 12.5e6)  # partly refilled
    assert tbf.seconds(100.0, workers=2, idle_s=1.0) == 0.0
    with pytest.raises(ValueError, match=r"mbit=-1 is invalid: expected a rate >= 0"):
        Link(mbit=-1)


def test_sync_bytes_follow_the_torch_transports_paths() -> None:
    int4 = codec_for("int4")
    assert sync_bytes(TINY, "fp32", workers=2) == 4 * TINY  # a ring of 2: each sends its half twice
    assert sync_bytes(TINY, "int4", workers=2) == int4.payload_bytes(TINY)  # one payload to the one peer
    assert sync_bytes(TINY, "fp32", workers=4, rule=MergeRule.MEAN) == 2 * 3 * TINY * 4 // 4
    assert sync_bytes(TINY, "int4", workers=8) == 7 * int4.payload_bytes(TINY)  # every payload to every peer
    shard = -(-TINY // (9 * int4.block)) * int4.block  # scatter-gather: 8 shard payloads out, 8 fp32 shards out
    assert sync_bytes(TINY, "int4", workers=9) == 8 * (int4.payload_bytes(shard) + 4 * shard)
    assert sync_bytes(TINY, "int4", workers=9) < 8 * int4.payload_bytes(TINY)  # where it sends fewer bytes
    topk = codec_for("topk")  # its payloads go to every peer up to GATHER_RANKS (its bytes alone: 114)
    assert sync_bytes(TINY, "topk", workers=GATHER_RANKS) == (GATHER_RANKS - 1) * topk.payload_bytes(TINY)
    shard = -(-TINY // (9 * topk.block)) * topk.block
    assert sync_bytes(TINY, "topk", workers=9) == 8 * (topk.payload_bytes(shard) + 4 * shard)
    # Measured by the benchmark's calibration run (2 gloo workers, tiny model): 474,408 bytes per int4 round,
    # its buckets' payloads; the whole model's payload in one piece is within 0.2% of it.
    assert sync_bytes(TINY, "int4", workers=2) == pytest.approx(474_408, rel=2e-3)


def test_each_mode_waits_for_what_its_compute_does_not_hide() -> None:
    link = Link(mbit=100, shared=True)
    t = link.seconds(1e6, workers=2)  # 0.16 s
    kw = {"step_s": 0.1, "round_bytes": 1e6, "link": link, "workers": 2}
    assert seconds_per_round(**kw, method=Method("blocking", 10)) == pytest.approx(1.0 + t)
    assert seconds_per_round(**kw, method=Method("eager", 10)) == pytest.approx(1.0)  # 0.16 s behind 1 s of steps
    assert seconds_per_round(**kw, method=Method("eager", 1)) == pytest.approx(0.1 + (t - 0.1))
    # streaming: 2 fragment syncs of half the bytes, each behind 1 step
    assert seconds_per_round(**kw, method=Method("streaming", 10, fragments=2, overlap_steps=0)) == pytest.approx(
        1.0 + 2 * t / 2
    )
    assert seconds_per_round(**kw, method=Method("streaming", 10, fragments=2, overlap_steps=1)) == pytest.approx(1.0)
    assert ddp_seconds(step_s=0.1, grad_bytes=1e6, link=link, workers=2) == pytest.approx(0.1 + t)
    with pytest.raises(ValueError, match=r"mode='lazy' is invalid"):
        Method("lazy", 10)


def test_a_sync_waits_for_the_one_way_latencies_its_transport_makes_one_after_another() -> None:
    # torch: the header's all-gather (a ring: W - 1 hops), then the payload path's own
    assert route(TINY, "fp32", transport="torch", workers=4, rule=MergeRule.MEAN).latencies == 3 + 6  # a ring
    assert route(TINY, "int4", transport="torch", workers=4).latencies == 3 + 1  # pairwise exchange
    assert route(TINY, "int4", transport="torch", workers=9).latencies == 8 + 1 + 8  # all-to-all, all-gather
    # hivemind: its round's phases; every member's payload to every other member, through the parts' owners
    hm = route(TINY, "int4", transport="hivemind", workers=4)
    assert hm.latencies == sum(n for _, n in HIVEMIND_PHASES) + 2 == 19  # an owner's stream: one window more
    # the transport's own count in a 4-peer run (bench/reachability.py): 1,422,696 bytes out of each peer
    assert hm.bytes_out == 3 * codec_for("int4").payload_bytes(TINY) == pytest.approx(1_422_696, rel=2e-3)
    assert route(TINY, "int4", transport="hivemind", workers=1) == route(TINY, "int4", transport="torch", workers=1)
    # behind NAT: the public peer owns every part and returns each client the 3 others' payloads (1.4 MB: two
    # flow-control windows more), and the relay digests and the confirmation between clients cross the relay
    nat = route(TINY, "int4", transport="hivemind", workers=4, clients=3)
    assert nat.latencies == 2 + 9 + (2 + 4) + 4 + 4 == 25
    assert nat.bytes_out == 9 * codec_for("int4").payload_bytes(TINY)  # the owner's: 3 payloads to each of 3
    assert route(TINY, "int4", transport="hivemind", workers=4, clients=1).latencies == 19  # no client pair
    with pytest.raises(ValueError, match=r"clients=4 is invalid: expected in \[0, workers - 1 = 3\]"):
        route(TINY, "int4", transport="hivemind", workers=4, clients=4)
    with pytest.raises(ValueError, match=r"clients=1 is invalid on torch"):
        route(TINY, "int4", transport="torch", workers=4, clients=1)
    with pytest.raises(ValueError, match=r"transport='gloo' is invalid: expected one of \['torch', 'hivemind'\]"):
        route(TINY, "int4", transport="gloo", workers=4)
    link = Link(mbit=100, latency_ms=100)
    assert link.seconds(1.25e6, workers=4, latencies=19) == pytest.approx(1.9 + 0.1)
    kw = {"step_s": 0.4, "round_bytes": 1.25e6, "link": link, "workers": 4, "method": Method("blocking", 10)}
    assert seconds_per_round(**kw, latencies=19) == pytest.approx(4.0 + 2.0)
    assert ddp_seconds(step_s=0.1, grad_bytes=1.25e6, link=link, workers=4) == pytest.approx(0.1 + 0.6 + 0.1)  # 6 hops


@pytest.mark.timeout(60)
def test_plan_on_hivemind_charges_its_rounds_bytes_and_latencies(capsys: pytest.CaptureFixture) -> None:
    # bench/reachability.py's links: 100 Mbit/s each, 50 ms one-way each, so 100 ms from peer to peer
    argv = ["plan", "--params", str(TINY), "--step-s", "0.385", "--link-mbit", "100", "--latency-ms", "100"]
    assert main([*argv, "--workers", "4", "--transport", "hivemind", "--inner-steps", "10"]) == 0
    out = capsys.readouterr().out
    sync = 19 * 0.1 + 3 * codec_for("int4").payload_bytes(TINY) / 12.5e6
    assert "waits for 19 one-way latencies" in out and f": {sync:.3f} s on the link" in out
    assert _row(out, 10)[1:3] == [f"{100 * 3.85 / (3.85 + sync):.1f}%", f"{100 * (3.85 + sync):,.0f}"]
    assert main([*argv, "--workers", "4", "--transport", "hivemind", "--clients", "3"]) == 0
    assert "waits for 25 one-way latencies" in capsys.readouterr().out
    assert main([*argv, "--workers", "4", "--transport", "hivemind", "--clients", "4"]) == 2
    assert "--clients=4 is invalid: expected in [0, --workers - 1]" in capsys.readouterr().err


def _row(out: str, h: int) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"| {h} |"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.timeout(60)
def test_plan_prints_the_models_figures_for_the_benchmarks_configuration(capsys: pytest.CaptureFixture) -> None:
    # bench/time_to_loss.py at 100 Mbit/s: 2 gloo workers on one shaped queue, tiny model, int4, H = 10,
    # a step of 0.09 s (its runs' mean compute at batch 16 x 64)
    argv = ["plan", "--params", str(TINY), "--step-s", "0.09", "--link-mbit", "100", "--shared", "--burst-kb", "512"]
    assert main([*argv, "--workers", "2", "--inner-steps", "1,10,100", "--fragments", "2", "--overlap-steps", "1"]) == 0
    out = capsys.readouterr().out
    link = Link(mbit=100, shared=True, burst_bytes=512 * 1024)  # bench/time_to_loss.py's link_of("100mbit")
    nbytes = sync_bytes(TINY, "int4", workers=2)
    blocking = seconds_per_round(step_s=0.09, round_bytes=nbytes, link=link, workers=2, method=Method("blocking", 10))
    util, per_1k = _row(out, 10)[1:3]
    assert util == f"{100 * 0.9 / blocking:.1f}%" and per_1k == f"{1000 * blocking / 10:,.0f}"
    ddp = ddp_seconds(step_s=0.09, grad_bytes=4 * TINY, link=link, workers=2)
    assert f"{1000 * ddp:,.0f} s per 1,000 steps, utilization {100 * 0.09 / ddp:.1f}%" in out
    # the smallest H at or above 90%: blocking 10 (at H = 1, 0.95 MB from both workers less the 0.52 MB burst
    # still waits 0.034 s after each 0.09 s step: 73%)
    assert re.search(r"blocking: H = 10 \(9\d\.\d%\)", out), out
    assert _row(out, 1)[1] == f"{100 * 0.09 / (0.09 + (2 * nbytes - 512 * 1024) / 12.5e6):.1f}%"
    assert _row(out, 1)[3:5] == ["n/a", "n/a"]  # streaming with overlap_steps >= H: refused by the trainer
    assert "predicted, not measured" in out and "assumptions:" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("link_name", ["100mbit", "1gbit"])
@pytest.mark.parametrize("method_name", ["diloco", "eager", "streaming-warm-fp32", "sign-warm-fp32"])
def test_plan_gives_the_benchmarks_prediction_for_each_of_its_configurations(
    capsys: pytest.CaptureFixture, link_name: str, method_name: str
) -> None:
    """``diloco plan`` with the flags that describe a time-to-loss run gives the seconds per round that the
    benchmark's prediction (``time_to_loss.predict``, checked against the measured runs) charges it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from time_to_loss import METHODS, link_of

    settings, method = METHODS[method_name]
    codec = next((x.split("=")[1] for x in settings if x.startswith("diloco.codec=")), "int4")
    link = link_of(link_name, simulated=False)
    argv = ["plan", "--params", str(TINY), "--step-s", "0.09", "--link-mbit", f"{link.mbit:g}", "--shared"]
    argv += ["--burst-kb", f"{link.burst_bytes / 1024:g}", "--workers", "2", "--codec", codec, "--inner-steps", "10"]
    argv += ["--fragments", str(method.fragments), "--overlap-steps", str(method.overlap_steps)]
    assert main(argv) == 0
    row = _row(capsys.readouterr().out, 10)
    col = {"blocking": 1, "streaming": 3, "eager": 5}[method.mode]
    per_round = seconds_per_round(
        step_s=0.09, round_bytes=sync_bytes(TINY, codec, workers=2), link=link, workers=2, method=method
    )
    assert row[col : col + 2] == [f"{100 * 0.9 / per_round:.1f}%", f"{1000 * per_round / 10:,.0f}"]


@pytest.mark.timeout(60)
def test_plan_says_when_no_h_reaches_the_target_and_refuses_bad_input(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "--params", "1.1b", "--step-s", "0.5", "--link-mbit", "10", "--inner-steps", "1,10"]
    assert main(argv) == 0
    assert "blocking: none of the H listed" in capsys.readouterr().out
    assert main(["plan", "--params", "150m", "--step-s", "0.5", "--link-mbit", "-5"]) == 2
    assert "diloco: error: --link-mbit=-5.0 is invalid: expected >= 0 (0: no limit)" in capsys.readouterr().err
    assert main(["plan", "--params", "150m", "--step-s", "0.5", "--link-mbit", "1000", "--workers", "1"]) == 2
    assert "--workers=1 is invalid: expected >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "many", "--step-s", "0.5", "--link-mbit", "100"])
    assert e.value.code == 2
    assert "'many' is not a count" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_plan_prices_a_topk_wire_at_its_settings_and_names_a_bad_one(capsys: pytest.CaptureFixture) -> None:
    argv = ["plan", "--params", "150m", "--step-s", "0.3", "--link-mbit", "1000", "--codec", "topk"]
    assert main([*argv, "--codec-block", "4096", "--codec-density", "0.015625", "--codec-value-bits", "4"]) == 0
    out = capsys.readouterr().out
    topk = codec_for("topk", 4096, density=1 / 64, value_bits=4)  # 64 of each 4096 values, 16 bits each
    assert "4 workers, topk4k64b4096 pseudo-gradients" in out
    assert f"a round sends {sync_bytes(150_000_000, topk, workers=4) / 1e6:,.2f} MB" in out
    assert sync_bytes(150_000_000, topk, workers=4) == 3 * topk.payload_bytes(150_000_000)  # unreduced, to each
    assert main([*argv]) == 0 and "4 workers, topk pseudo-gradients" in capsys.readouterr().out  # its defaults
    for flag, value, valid in [
        ("--codec-density", "0.9", r"expected a number in \(0, 0.5\]"),
        ("--codec-value-bits", "3", "expected 2 or 4"),
        ("--codec-block", "100", r"expected a power of two in \[16, 65536\]"),
        ("--codec-density", "0.001", r"expected a number in \[0.00195312, 0.5\] at --codec-block=256"),
    ]:
        assert main([*argv, flag, value]) == 2
        assert re.search(f"{flag}={value} is invalid: {valid}", capsys.readouterr().err)
    # checked as the trainer's [diloco] section is, whatever the codec: a setting it would refuse is refused here
    assert main([*argv[:-1], "int4", "--codec-value-bits", "3"]) == 2
    assert "--codec-value-bits=3 is invalid: expected 2 or 4" in capsys.readouterr().err
    assert main([*argv[:-1], "sign", "--codec-block", "16"]) == 2
    assert (
        "--codec-block=16 is invalid: expected a power of two in [32, 65536] for codec='sign'"
        in capsys.readouterr().err
    )


MEASURED_PEAKS = [
    # (transport, wire, parameters, measured peak per worker in MiB, where): bench/scale.py's peaks
    # (PSS less mapped files) and bench/preset_run.py's at the 150m preset (each tree's whole PSS)
    ("torch", "fp32", 5_114_112, 398, "scale"),
    ("torch", "fp32", 20_010_496, 847, "scale"),
    ("torch", "int4", 5_114_112, 535, "scale"),
    ("torch", "int4", 20_010_496, 1110, "scale"),
    ("hivemind", "fp32", 5_114_112, 966, "scale"),
    ("hivemind", "fp32", 20_010_496, 1664, "scale"),
    ("hivemind", "int4", 5_114_112, 1115, "scale"),
    ("hivemind", "int4", 20_010_496, 1957, "scale"),
    ("hivemind", "int4", 151_800_576, 9.14 * 1024, "150m, peer 0"),
    ("hivemind", "int4", 151_800_576, 8.76 * 1024, "150m, peer 1"),
    ("torch", "int4", 151_800_576, 12.09 * 1024 / 2, "150m, half the tree of 2 workers"),
]


@pytest.mark.parametrize(("transport", "wire", "params", "peak_mib", "where"), MEASURED_PEAKS)
def test_plans_memory_is_within_ten_percent_of_every_measured_peak(
    transport: str, wire: str, params: int, peak_mib: float, where: str
) -> None:
    from diloco_train.memory import memory

    got = memory(params, transport=transport, wire=wire).total / 2**20
    assert abs(got / peak_mib - 1) <= 0.10, (where, got, peak_mib)


def test_plan_prints_a_workers_memory_or_says_it_was_not_measured(capsys: pytest.CaptureFixture):
    argv = ["plan", "--params", "150m", "--step-s", "2", "--link-mbit", "1000"]
    assert main([*argv, "--inner-steps", "10", "--transport", "hivemind"]) == 0
    out = capsys.readouterr().out
    held = r"memory per worker: training 3\.07 GB .*DiLoCo 6\.49 GB more .*9\.56 GB in all"
    assert re.search(held, out), out
    assert main([*argv, "--inner-steps", "10", "--codec", "fp16"]) == 0
    said = "DiLoCo's for fp16 on torch: not measured (measured: fp32, int4)"
    assert said in capsys.readouterr().out
