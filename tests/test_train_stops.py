"""The two owners of what one invocation's workers change together: ``Stops`` and ``Outcome``."""

from __future__ import annotations

import threading

from diloco_core import TransportError
from diloco_train.outcome import Outcome
from diloco_train.stops import Stops


def test_a_signal_before_any_step_stops_at_once_and_after_one_at_the_furthest_step_begun():
    stops = Stops()
    assert not stops.softly() and not stops.interrupted  # nothing begun: nothing to checkpoint
    assert not stops.here(0, 4) and not stops.here(1, 9)  # rank 0 begins step 5, rank 1 step 10
    assert stops.softly() and stops.interrupted
    assert not stops.here(0, 5)  # rank 0 goes on to the furthest step begun (10), then stops there
    assert stops.here(1, 10) and stops.here(0, 10) and not stops.now


def test_a_failure_stops_every_worker_at_once():
    stops = Stops()
    stops.at_once()
    assert stops.now and not stops.interrupted


def test_the_cause_is_the_first_error_that_is_not_a_transport_failing_because_of_it():
    outcome = Outcome()
    assert outcome.cause() is None
    lost, cause = TransportError("peer gone"), ValueError("bad batch")
    outcome.failed(lost)
    outcome.failed(cause)
    assert outcome.cause() is cause
    only = Outcome()
    only.failed(lost)
    assert only.cause() is lost


def test_the_nonfinite_warning_is_said_once_per_process_whatever_the_threads():
    outcome = Outcome()
    firsts: list[bool] = []
    threads = [threading.Thread(target=lambda: firsts.append(outcome.first_nonfinite_state())) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert sorted(firsts) == [False] * 7 + [True]


def test_busy_seconds_are_kept_per_rank():
    outcome = Outcome()
    outcome.busy(0, 1.0)
    outcome.busy(1, 2.0)
    outcome.busy(0, 3.0)
    assert sorted(outcome.busy_seconds()) == [2.0, 3.0]
