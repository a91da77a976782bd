"""hivemind's log records that the transport handles itself: none of them is an ERROR with a traceback.

hivemind logs an exception that ends an averaging step, and a failed state download from one donor, as an
ERROR with its traceback. Where the transport handles the case, that is noise a user takes for a failure:

- a step that found no group (the peer averages alone: one warning line of the transport's);
- a group whose state tags differ (a retry without the stale peers, or the group's state: the transport's
  warning lines);
- a round not committed (a groupmate left or failed mid-round: the transport retries among the survivors
  and says so in one warning line with hivemind's reason);
- a donor that left (a peer killed or restarted, whose record in the DHT has not expired yet): hivemind
  tries the next donor; one WARNING line without the traceback says which one failed;
- a request the DHT process could not read from its pipe because its sender exited meanwhile (a
  peer interrupted in a round: the request's future travels as a connection its sender hands
  over): the DHT reads the next one; one WARNING line without the traceback.
"""

import logging

from hivemind.averaging.allreduce import AllreduceException

from .state_tag import StaleStateError

__all__ = ["quiet_hivemind_records"]


def quiet_hivemind_records(record: logging.LogRecord) -> bool:
    """A ``logging`` filter for ``hivemind.averaging.averager`` and ``hivemind.dht.dht``: False
    drops ``record``; a failed download from one donor, or a DHT request lost with its sender,
    becomes a WARNING line without the traceback."""
    error = record.exc_info[1] if record.exc_info else record.msg
    if isinstance(error, StaleStateError):
        return False
    if isinstance(error, AllreduceException) and "could not find a group" in str(error):
        return False
    # An uncommitted round: raised by our confirmation, and again as hivemind wraps it.
    if isinstance(error, Exception) and "round not committed" in str(error):
        return False
    if (
        record.name == "hivemind.dht.dht"
        and record.funcName == "_run"
        and isinstance(error, OSError)
    ):
        record.msg, record.args = (
            "a DHT request was lost: its sender exited before it was read (%r)",
            (error,),
        )
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.exc_info, record.exc_text = None, None
    if record.funcName == "_load_state_from_peers" and record.levelno >= logging.ERROR:
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.exc_info, record.exc_text = None, None  # the next donor is tried
    return True
