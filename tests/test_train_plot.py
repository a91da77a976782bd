"""``diloco plot``: each x axis drawn from the right records, the warm start shaded, a swarm's contributors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
import pytest

from diloco_train.cli import main
from diloco_train.report.plot import draw_runs
from diloco_train.report.plot_data import AXES, read_run

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(60)  # matplotlib's first import and a few small figures


def _step(step: int, *, sent: int, time_s: float, rnd: int = 0) -> dict[str, Any]:
    return {"type": "step", "step": step, "round": rnd, "loss": 5.0 - 0.1 * step, "bytes_sent": sent, "time_s": time_s}


def _round(step: int, *, contributors: int, sent: int) -> dict[str, Any]:
    return {"type": "round", "step": step, "num_contributors": contributors, "bytes_sent": sent, "agreement": 0.9}


def _eval(step: int, *, loss: float, time_s: float, eval_s: float) -> dict[str, Any]:
    return {"type": "eval", "step": step, "loss": loss, "time_s": time_s, "eval_s": eval_s}


def _write(run: Path, records: list[dict[str, Any]], *, mode: str, transport: str = "inprocess") -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.toml").write_text(f'[train]\nmode = "{mode}"\n\n[transport]\nkind = "{transport}"\n')
    return run


def _diloco(run: Path, *, transport: str = "inprocess", contributors: tuple[int, int] = (2, 2)) -> Path:
    """2 warm-start DDP steps of 100 bytes, then rounds at steps 4 and 6 (1000 bytes each); an eval of 3 s after
    step 4, which the time axis leaves out of step 5 on."""
    records = [
        _eval(0, loss=6.0, time_s=0.0, eval_s=0.0),
        _step(1, sent=100, time_s=1.0),
        _step(2, sent=100, time_s=2.0),
        _step(3, sent=0, time_s=3.0),
        _round(4, contributors=contributors[0], sent=1000),
        _step(4, sent=1000, time_s=4.0, rnd=1),
        _eval(4, loss=4.0, time_s=7.0, eval_s=3.0),
        _step(5, sent=0, time_s=8.0, rnd=1),
        _round(6, contributors=contributors[1], sent=1000),
        _step(6, sent=1000, time_s=9.0, rnd=2),
        _eval(6, loss=3.0, time_s=11.0, eval_s=2.0),
    ]
    return _write(run, records, mode="diloco", transport=transport)


def _lines(ax: Any) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        for line in ax.get_lines()
    }


def test_each_x_axis_places_the_records_where_they_happened(tmp_path: Path) -> None:
    run = read_run(_diloco(tmp_path / "d"))
    assert run.mode == "diloco" and run.warm_start == 2 and len(run.rounds) == 2
    assert run.x("bytes", [0, 2, 4, 6]) == [0.0, 200.0, 1200.0, 2200.0]
    assert run.x("time", [0, 4, 5, 6]) == [0.0, 4.0, 5.0, 6.0]  # the 3 s eval after step 4 left out
    fig = draw_runs([run], axes=AXES)
    (step_ax, bytes_ax, time_ax), (agree_step, agree_bytes, _) = fig.axes[:3], fig.axes[3:6]
    assert _lines(step_ax)["d eval"] == ([0.0, 4.0, 6.0], [6.0, 4.0, 3.0])
    xs, ys = _lines(bytes_ax)["d eval"]
    assert xs == pytest.approx([0.0, 1200e-6, 2200e-6]) and ys == [6.0, 4.0, 3.0]  # in MB
    assert _lines(time_ax)["d eval"] == ([0.0, 4.0, 6.0], [6.0, 4.0, 3.0])
    assert _lines(time_ax)["d train (EMA)"][0] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert _lines(agree_step)["d"] == ([4.0, 6.0], [0.9, 0.9])
    assert _lines(agree_bytes)["d"][0] == pytest.approx([1200e-6, 2200e-6])
    assert len(fig.axes) == 6  # in-process: no contributors panel
    # The warm start: shaded from 0 to its last step, on each axis in its units.
    for ax, right in ((step_ax, 2.0), (bytes_ax, 200e-6), (time_ax, 2.0)):
        (span,) = [p for p in ax.patches if "warm start" in p.get_label()]
        assert span.get_x() == 0.0 and span.get_x() + span.get_width() == pytest.approx(right)


def test_ddp_and_one_worker_beside_diloco_and_a_swarms_contributors(tmp_path: Path) -> None:
    swarm = read_run(_diloco(tmp_path / "swarm", transport="hivemind", contributors=(3, 2)))
    ddp = [_eval(0, loss=6.0, time_s=0.0, eval_s=0.0)]
    ddp += [_step(s, sent=100_000, time_s=float(s)) for s in range(1, 4)] + [_eval(3, loss=4, time_s=3, eval_s=1)]
    ddp += [_step(s, sent=100_000, time_s=float(s)) for s in range(4, 7)] + [_eval(6, loss=2.5, time_s=7, eval_s=1)]
    ddp_run = read_run(_write(tmp_path / "ddp", ddp, mode="ddp"))
    single = [_step(s, sent=0, time_s=float(s)) for s in range(1, 7)] + [_eval(6, loss=3.5, time_s=6.5, eval_s=0.5)]
    single_run = read_run(_write(tmp_path / "one", single, mode="single"))
    assert ddp_run.warm_start == 0 and single_run.warm_start == 0  # no rounds: nothing to shade
    # A hivemind peer that never met another: rounds of its own, nothing sent.
    lone = [_step(s, sent=0, time_s=float(s)) for s in range(1, 5)]
    lone += [_round(4, contributors=1, sent=0), _eval(4, loss=4.5, time_s=5.0, eval_s=1.0)]
    lone_run = read_run(_write(tmp_path / "lone", lone, mode="diloco", transport="hivemind"))
    fig = draw_runs([swarm, ddp_run, single_run, lone_run], axes=["bytes"])
    loss_ax, agreement_ax, contributors_ax = fig.axes
    assert loss_ax.get_xscale() == "log"  # DDP sent 273 times the swarm's bytes
    lines = _lines(loss_ax)
    assert lines["ddp eval"] == (pytest.approx([0.3, 0.6]), [4.0, 2.5])  # log scale: the eval at 0 bytes left out
    assert lines["one final eval (sends nothing)"][1] == [3.5, 3.5]
    assert lines["lone final eval (sends nothing)"][1] == [4.5, 4.5]
    assert set(_lines(agreement_ax)) == set(_lines(contributors_ax)) == {"swarm"}  # not the lone peer's at 0
    xs, ys = _lines(contributors_ax)["swarm"]
    assert xs == pytest.approx([1200e-6, 2200e-6]) and ys == [3, 2]


def test_cli_draws_all_three_axes_and_refuses_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _diloco(tmp_path / "d")
    assert main(["plot", str(run), "--x", "all", "--out", str(tmp_path / "all.png")]) == 0
    assert (tmp_path / "all.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        main(["plot", str(run), "--x", "tokens"])
    assert "invalid choice: 'tokens'" in capsys.readouterr().err
