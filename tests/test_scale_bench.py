"""bench/scale.py's accounting: the slope and fixed part of DiLoCo's memory, the per-worker figures,
and the walk that finds every tensor a DiLoCo holds (on a tiny model, in this process)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from scale import by_component, component_of, plot, slope_of, summarize, tensor_account

from diloco_core import DiLoCo, DiLoCoConfig
from transports import InProcessGroup

MIB = 2**20


def test_the_slope_is_bytes_per_parameter_and_the_intercept_the_fixed_part():
    points = [(n, n * 20.5 + 300 * MIB) for n in (5_000_000, 20_000_000)]
    slope, fixed = slope_of(points)
    assert slope == pytest.approx(20.5)
    assert fixed == pytest.approx(300 * MIB)
    with pytest.raises(ValueError, match="two sizes"):
        slope_of([(5, 1.0), (5, 2.0)])


def _record(transport: str, *, params: int, peak: float, workers: int, processes: int) -> dict:
    account = {"global copy": 4 * params}
    process = {"peak": {"Pss": peak, "Pss_Mem": peak}, "vmhwm": peak, "account": account}
    size = f"{params // 10**6}m"
    return {
        "transport": transport,
        "codec": "fp32",
        "size": size,
        "params": params,
        "workers_per_process": workers,
        "processes": [process] * processes,
    }


def test_the_figures_are_per_worker_above_the_baseline_of_as_many_workers_per_process():
    """In-process: one process of 2 workers, against the baseline of 2 workers in one process (not
    the single-worker one); its peaks, account and slope are halved. torch: a worker a process."""
    records = []
    for n in (5 * 10**6, 20 * 10**6):
        one, two = {"workers": 1, "processes": 1}, {"workers": 2, "processes": 1}
        records.append(_record("baseline", params=n, peak=100 * MIB + 16 * n, **one))
        records.append(_record("baseline", params=n, peak=150 * MIB + 32 * n, **two))
        records.append(_record("inprocess", params=n, peak=250 * MIB + 32 * n + 2 * 14 * n, **two))
        peak = 180 * MIB + 16 * n + 13 * n
        records.append(_record("torch", params=n, peak=peak, workers=1, processes=2))
    rows = {(r["transport"], r["params"]): r for r in summarize(records)}
    assert set(rows) == {(t, n) for t in ("inprocess", "torch") for n in (5 * 10**6, 20 * 10**6)}
    inproc, torch_row = rows["inprocess", 5 * 10**6], rows["torch", 20 * 10**6]
    assert inproc["slope_Pss"] == pytest.approx(14.0)
    assert inproc["fixed_Pss"] == pytest.approx(50 * MIB)  # (250 - 150) MiB over 2 workers
    assert inproc["account"] == {"global copy": pytest.approx(2 * 5 * 10**6)}  # 4 B/param over 2
    assert torch_row["slope_Pss"] == pytest.approx(13.0)
    assert torch_row["fixed_Pss"] == pytest.approx(80 * MIB)
    assert torch_row["slope_account"] == pytest.approx(4.0)


def test_the_plot_is_written_from_the_rows_the_table_reads(tmp_path):
    """The log-log plot (peaks beside the baseline, DiLoCo's part) of three sizes, as an image."""
    records = []
    for n in (10**6, 20 * 10**6, 150 * 10**6):
        base, peak = 200 * MIB + 19 * n, 250 * MIB + 41 * n
        records.append(_record("baseline", params=n, peak=base, workers=1, processes=1))
        records.append(_record("torch", params=n, peak=peak, workers=1, processes=2))
    out = tmp_path / "scale.png"
    plot(records, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_component_only_one_process_holds_counts_at_its_mean_over_the_processes():
    """A hivemind joiner holds the state it downloaded, the first peer not: per worker, half."""
    records = []
    for n in (5 * 10**6, 20 * 10**6):
        records.append(_record("baseline", params=n, peak=16 * n, workers=1, processes=1))
        record = _record("hivemind", params=n, peak=40 * n, workers=1, processes=2)
        first, joiner = record["processes"]
        account = {**joiner["account"], "downloaded": 4 * n}
        record["processes"] = [first, {**joiner, "account": account}]
        records.append(record)
    row = summarize(records)[0]
    assert row["account"] == {"global copy": 4 * 5 * 10**6, "downloaded": 2 * 5 * 10**6}
    assert row["slope_account"] == pytest.approx(6.0)
    assert row["slope_Pss"] == pytest.approx(24.0)


def test_a_storage_is_the_first_component_any_of_its_paths_names():
    momentum = "rank0.outer_optimizer.state[0]['momentum_buffer']"
    assert component_of(["rank0.fragments[0].param", momentum]) == "outer momentum"
    reduce = ["rank0.fragments[0].reduce.flat", "rank0.fragments[0].param.grad"]
    assert component_of(reduce) == "reduce buffer"
    assert component_of(["rank0.rounds._global.flat"]) == "global copy"
    assert component_of(["rank0.transport._buffers['k']._cache[0]"]) == "transport buffers"
    assert component_of(["rank0.something"]) == "other"


def test_the_walk_finds_every_tensor_a_diloco_holds_once_and_none_of_the_model():
    """A tiny model, int4 with error feedback, after one round on a group of one: global copy, outer
    momentum, reduce buffer, both residuals, the feedback's payload and the codec's workspace (this
    thread's), each found once (the global
    copy is also each fragment's slice and the outer SGD's parameter; the reduce buffer its
    gradient),
    the model's parameters, gradients and AdamW's moments not at all."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 20))
    n = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transport = InProcessGroup(1).transport(0)
    config = DiLoCoConfig(inner_steps=1, codec="int4", reduce_timeout=10.0)
    dl = DiLoCo(model, inner, transport, config)
    model(torch.randn(8, 40)).square().mean().backward()
    assert dl.step() is not None  # one round: the outer momentum exists now
    held = tensor_account({"rank0": dl}, skip=[model, inner])
    parts = by_component(held)
    workspace = parts.pop("codec workspace")  # this thread's chunk buffers: 2**20 values at most
    assert 0 < workspace <= (4 + 1 + 4) * 2**20
    reduce = dl.fragments[0].reduce.flat.numel()
    payload = dl.codec.payload_bytes(reduce)
    assert parts == {
        "global copy": 4 * n,
        "outer momentum": 4 * n,
        "reduce buffer": 4 * reduce,
        "error-feedback residual": 4 * reduce,
        "error-feedback next residual": 4 * reduce,
        "error-feedback payload": payload,
    }
    assert reduce > n  # the guard's tail, in codec blocks after the values
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moments = [t for s in inner.state.values() for t in s.values()]
    model_storages |= {t.untyped_storage().data_ptr() for t in moments}
    assert not model_storages & {ptr for _, ptr in held}
    assert transport is dl.transport
    transport.close()
