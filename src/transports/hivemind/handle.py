"""What an ``all_reduce`` returns: a handle whose wait, once it runs out, forbids any later commit."""

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from diloco_core.transport import FutureHandle, ReduceResult, StateReplaced


@dataclass
class Outcome:
    """What one reduce did to the caller's state, set under the transport's lock."""

    abandoned: bool = False
    """The caller's wait ran out: nothing may be copied into its tensors or state any more."""
    replaced: StateReplaced | None = None
    """The caller's state is to be replaced by the group's (set before the reduce's future completes)."""
    load: Callable[[], None] | None = None
    """Loads the group's state (checked already): run by the caller's wait, once, before it raises ``replaced``."""
    result: ReduceResult | None = None
    """The reduce committed (set with the commit, before the future completes)."""


class Handle(FutureHandle):
    """Marks the reduce abandoned when the caller's wait times out, so a late result is never copied
    into tensors the caller has taken back (the reduce checks the mark under the same lock). When the
    group's state replaces the caller's, the wait loads it, in the caller's thread."""

    def __init__(
        self, future: concurrent.futures.Future, outcome: Outcome, lock: threading.Lock
    ) -> None:
        super().__init__(future, "hivemind all_reduce")
        self._outcome, self._lock = outcome, lock

    def wait(self, timeout: float) -> ReduceResult:
        try:
            return super().wait(timeout)
        # a timeout, or Ctrl+C: nothing may be committed once the caller has left
        except BaseException as e:
            with self._lock:
                committed, replaced = self._outcome.result, self._outcome.replaced
                if committed is None and replaced is None:
                    self._outcome.abandoned = True
            if not isinstance(e, Exception):
                raise  # Ctrl+C still stops the caller
            if committed is not None:
                return committed  # it committed just as the wait ran out
            # the caller's thread loads the group's state: nothing changes under its training
            if replaced is not None:
                load, self._outcome.load = self._outcome.load, None
                if load is not None:
                    load()
                raise replaced from None
            raise

    def completed(self) -> ReduceResult | None:
        with self._lock:
            return None if self._outcome.abandoned else self._outcome.result
