"""The CLI end to end: a short run writes its files, resume is exact, bad input exits cleanly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import FAST, losses

from diloco_train.cli import main


@pytest.mark.timeout(60)
def test_short_run_writes_metrics_config_plot_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    run = tmp_path / "r"
    assert (run / "config.toml").is_file() and (run / "plot.png").stat().st_size > 1000
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds.count("step") == 12 and kinds.count("round") == 4 and kinds[-1] == "summary"
    assert all(r["num_contributors"] == 2 and r["bytes_sent"] > 0 for r in records if r["type"] == "round")
    assert {"loss", "lr", "tokens_per_s", "compute_s", "comm_s", "bytes_sent"} <= set(records[1])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step00000009-rank0.pt",
        "step00000009-rank1.pt",
        "step00000012-rank0.pt",
        "step00000012-rank1.pt",
    ]
    out = capsys.readouterr().out
    assert "eval loss" in out and "perplexity" in out and "compute utilization" in out
    # Same name again without --resume: refused, nothing overwritten.
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["plot", str(run), str(run), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").is_file()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["diloco", "ddp", "ddp/sign"])  # ddp/sign: a lossy wire, its residual saved
def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path: Path, mode: str) -> None:
    mode, _, wire = mode.partition("/")
    common = ["--set", f"train.runs_dir={tmp_path!s}", "--set", f"train.mode={mode}", *FAST]
    common += ["--set", f"train.ddp_wire_dtype={wire}"] if wire else []
    assert main(["train", "--name", "whole", *common]) == 0
    # Stop after round 2 (step 6), then resume from the run's saved config and finish.
    assert main(["train", "--name", "split", *common, "--set", "train.stop_after=6"]) == 0
    assert len(losses(tmp_path / "split")) == 6
    if wire:  # what the wire dropped of the last gradient is in the checkpoint, and fed to the next one
        saved = torch.load(tmp_path / "split" / "checkpoints" / "step00000006-rank0.pt", weights_only=True)
        assert saved["core"]["ddp_residual"].abs().max() > 0
    assert main(["train", "--name", "split", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert len(whole) == 12 and split == whole


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "train.stpes=3"], "valid keys: ['mode', 'workers', 'steps'"),
        (["--set", "train.steps=many"], "steps='many' is invalid"),
        (["--set", "data.path=DIR/nothing-here"], "does not exist"),
        (["--set", "data.path=DIR/empty"], "holds no"),
        (["--set", "data.path=DIR/small.txt", "--set", "train.batch_size=5000"], "batch_size=5000 is larger"),
        (["--config", "DIR/missing.toml"], "does not exist"),
        (["--set", "train"], "section.key=value"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "small.txt").write_text("hello world\n" * 400)
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    assert main(["train", "--set", f"train.runs_dir={tmp_path!s}", *args, "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_a_missing_hivemind_is_one_line_with_a_quoted_install_command_before_the_run_starts(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['hivemind'] = None\n"  # as if it were not installed
        "from diloco_train.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["train", "--set", "transport.kind=hivemind", "--set", "train.shard=0", "--set", "train.num_shards=2"]
    args += ["--set", f"train.runs_dir={tmp_path!s}", "-q"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 2, out.stderr
    # one line, quoted for zsh (an unquoted diloco[hivemind] is a glob there), and no run header before it
    assert out.stderr.splitlines() == [
        "diloco: error: the hivemind transport needs hivemind, which is not installed: pip install 'diloco[hivemind]'"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_an_error_inside_the_worker_threads_ends_the_run_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "r", *common, "--set", "train.mode=ddp", "--set", "train.stop_after=3"]) == 0
    capsys.readouterr()
    # Every worker thread finds a ddp checkpoint where it expects a diloco one; none may hang. (--force: the
    # changed mode is refused up front otherwise, test_train_interrupts.py)
    assert main(["train", "--name", "r", "--resume", *common, "--set", "train.mode=diloco", "--force"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint is of a ddp run" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_resume_without_a_checkpoint_starts_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # What torchrun --max-restarts runs again after a crash before the first checkpoint (or at first start).
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST]
    assert main(["train", "--name", "fresh", "--resume", *common]) == 0
    run = tmp_path / "fresh"
    assert (run / "metrics.jsonl").is_file() and (run / "checkpoints").is_dir()


@pytest.mark.timeout(180)
def test_a_hivemind_peer_resumes_exactly(tmp_path: Path) -> None:
    """A transport without fixed ranks: no common resume step to agree on, DiLoCo's state (with the
    transport's state tag) comes back from the checkpoint. One peer, so every round averages alone."""
    pytest.importorskip("hivemind")
    hivemind = [
        "--set",
        "transport.kind=hivemind",
        "--set",
        'transport.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "--set",
        "transport.matchmaking_time=0.5",
        "--set",
        'transport.secret="s"',
        "--set",
        "train.shard=0",
        "--set",
        "train.num_shards=1",
    ]
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, *hivemind]
    assert main(["train", "--name", "whole", *common]) == 0
    assert main(["train", "--name", "split", *common, "--set", "train.stop_after=6"]) == 0
    # The secret is never written into the run's config: give it again.
    assert (
        main(
            [
                "train",
                "--name",
                "split",
                "--resume",
                "--set",
                f"train.runs_dir={tmp_path!s}",
                "-q",
                "--set",
                'transport.secret="s"',
            ]
        )
        == 0
    )
    whole, split = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert len(whole) == 12 and split == whole


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("warm", "stop_after", "inner"), [(4, 3, "adamw"), (4, 6, "adamw"), (6, 6, "adamw"), (4, 6, "muon")]
)
def test_a_ddp_warm_start_hands_over_to_diloco_and_resumes_exactly(
    tmp_path: Path, warm: int, stop_after: int, inner: str
) -> None:
    """``warm`` DDP steps (a gradient all-reduce each), then DiLoCo from those weights, a round every 3 steps.
    Stopped inside the warm start, at its last step or after it, the resumed run repeats the losses. muon: the
    inner optimizer is Muon and AdamW (train.inner_optimizer), in DDP's steps and in DiLoCo's checkpoint."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", f"train.ddp_warm_start={warm}"]
    common += ["--set", f"train.inner_optimizer={inner}"]
    assert main(["train", "--name", "whole", *common]) == 0
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    rounds = list(range(warm + 3, 13, 3))
    assert [r["bytes_sent"] > 0 for r in records if r["type"] == "step"] == [
        s <= warm or s in rounds for s in range(1, 13)
    ]
    assert [r["step"] for r in records if r["type"] == "round"] == rounds
    assert main(["train", "--name", "split", *common, "--set", f"train.stop_after={stop_after}"]) == 0
    assert main(["train", "--name", "split", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_after", [3, 6])
def test_a_warm_start_that_averages_updates_sends_every_step_and_resumes_exactly(tmp_path: Path, stop_after: int):
    """warm_start_sync = "updates": each of the 4 warm steps is a round of DiLoCo with H = 1 on the warm start's
    wire (here the 1-bit one, with its error feedback), then DiLoCo proper from those weights, every 3 steps."""
    common = ["--set", f"train.runs_dir={tmp_path!s}", *FAST, "--set", "train.ddp_warm_start=4"]
    common += ["--set", "train.warm_start_sync=updates", "--set", "train.ddp_wire_dtype=sign"]
    assert main(["train", "--name", "whole", *common]) == 0
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in records if r["type"] == "round"] == [7, 10]  # the warm steps are not outer rounds
    assert [r["bytes_sent"] > 0 for r in steps] == [s in (1, 2, 3, 4, 7, 10) for s in range(1, 13)]
    assert steps[0]["bytes_sent"] < 0.3 * steps[6]["bytes_sent"]  # sign: 0.035x of fp32, DiLoCo's int4: 0.129x
    assert main(["train", "--name", "split", *common, "--set", f"train.stop_after={stop_after}"]) == 0
    assert main(["train", "--name", "split", "--resume", "--set", f"train.runs_dir={tmp_path!s}", "-q"]) == 0
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")


@pytest.mark.timeout(60)
def test_the_summary_puts_diloco_traffic_against_ddp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wire = ["--set", "diloco.codec=int4"]
    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST, *wire]) == 0
    out = capsys.readouterr().out
    assert "compute utilization" in out and "goodput" in out
    # 12 steps, a round every 3: DDP would all-reduce the same number of values 12 times in fp32, DiLoCo
    # 4 times in int4 (4 bits a value and an fp32 scale per 256: 7.76x fewer bytes): 3 x 7.76.
    assert "DDP would have sent" in out and "23.3x what DiLoCo sent (4 rounds)" in out
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["type"] == "round"]
    assert all({"pseudo_grad_norm", "mean_pseudo_grad_norm", "agreement"} <= set(r) for r in rounds)
    assert all(0 <= r["agreement"] <= 1 + 1e-6 and r["pseudo_grad_norm"] > 0 for r in rounds)


@pytest.mark.timeout(60)
def test_an_unset_outer_lr_is_the_rule_for_the_worker_count(tmp_path: Path) -> None:
    import torch

    from diloco_core.config import outer_lr_for

    assert main(["train", "--name", "r", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    # The outer optimizer is saved once, in rank 0's file (in-process workers share it).
    state = torch.load(tmp_path / "r" / "checkpoints" / "step00000012-rank0.pt", weights_only=True)
    assert state["core"]["outer_optimizer"]["param_groups"][0]["lr"] == pytest.approx(outer_lr_for(2, 0.5))


def test_version_and_the_config_keys_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("diloco ")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for section in ("[model]", "[data]", "[train]", "[diloco]", "[transport]"):
        assert section in out
    # Generated from the dataclasses, with the trainer's own defaults where they differ from the core's.
    assert "steps=600" in out and "inner_steps=10" in out and "codec='int4'" in out and "reduce_timeout=600.0" in out


def test_plot_of_several_runs_goes_next_to_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--name", "a", "--set", f"train.runs_dir={tmp_path!s}", *FAST]) == 0
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert (tmp_path / "runs.png").stat().st_size > 1000
    # another axis never overwrites the run's own plot.png (the trainer's, step axis)
    own = (tmp_path / "a" / "plot.png").read_bytes()
    assert main(["plot", str(tmp_path / "a"), "--x", "all"]) == 0
    assert (tmp_path / "a" / "plot.png").read_bytes() == own
    assert (tmp_path / "a" / "plot-all.png").stat().st_size > 1000
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "a"), "--x", "time"]) == 0
    assert (tmp_path / "runs-time.png").stat().st_size > 1000


@pytest.mark.timeout(150)
def test_ctrl_c_ends_with_one_line_that_names_the_run(tmp_path: Path) -> None:
    """SIGINT mid-run, to a trainer started with SIGINT ignored (a script's background job): exit 130 and one
    line with the checkpoint the interrupt wrote and the real run name in the resume hint, no traceback."""
    cmd = [
        sys.executable,
        "-m",
        "diloco_train.cli",
        "train",
        "--name",
        "cut-short",
        "-q",
        "--set",
        f"train.runs_dir={str(tmp_path)!r}",
        "--set",
        "train.steps=5000",
        "--set",
        "train.workers=2",
        "--set",
        "model.num_layers=1",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509 - as `diloco train &` has it
    )
    try:
        metrics = tmp_path / "cut-short" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (
            not metrics.is_file() or metrics.read_text().count('"type": "step"') < 3
        ):
            time.sleep(0.2)
        assert metrics.is_file(), "the run logged no steps"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    # The hint is the whole command: this run's runs_dir is not the default.
    hint = f"diloco train --resume --name cut-short --set 'train.runs_dir=\"{tmp_path}\"'"
    ckpt = max((tmp_path / "cut-short" / "checkpoints").glob("step*-rank0.pt"))  # the interrupt's own
    step = int(ckpt.name[4:12])
    assert step >= 3
    assert err.strip().splitlines()[-1] == f"diloco: interrupted (SIGINT); newest checkpoint: step {step} " + (
        f"(resume with: {hint})"
    )
