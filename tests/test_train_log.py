"""The trainer's log lines are written above the progress bar, never onto its line."""

from __future__ import annotations

import io
import logging

from tqdm import tqdm

from diloco_train.report.log_tag import AboveTheBar


def test_a_warning_during_a_run_starts_a_line_of_its_own_above_the_bar() -> None:
    out = io.StringIO()
    handler = AboveTheBar(out)
    handler.setFormatter(logging.Formatter("[w] %(message)s"))  # no level: hivemind renames them
    log = logging.getLogger("diloco_test_above_the_bar")
    log.propagate = False
    log.addHandler(handler)
    try:
        bar = tqdm(total=10, file=out, mininterval=0, ascii=True)
        bar.update(3)
        log.warning("a round failed")
        bar.update(1)
        bar.close()
    finally:
        log.removeHandler(handler)
    line = next(x for x in out.getvalue().split("\n") if "a round failed" in x)
    # what the terminal shows of that line: the text after its last carriage return
    assert line.split("\r")[-1] == "[w] a round failed", repr(line)
    assert "4/10" in out.getvalue().split("a round failed")[1]  # the bar drawn again below it
