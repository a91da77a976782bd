"""Running a job's workers in this process: its one worker, or one thread per worker, the first error
re-raised."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from diloco_core import Transport

from .job import Job
from .worker import Worker

__all__ = ["run_workers"]


def run_workers(
    job: Job, *, transports: Sequence[Transport | None], show: bool, lead: bool
) -> None:
    """This process's one worker here, or its workers as threads."""
    if len(transports) > 1:
        _run_threads(job, transports=transports, show=show)
        return
    first = transports[0]
    Worker(
        job,
        rank=0 if first is None else first.rank,
        world_size=1 if first is None else first.world_size,
        transport=first,
        show=show and lead,
    ).run()


def _run_threads(job: Job, *, transports: Sequence[Transport | None], show: bool) -> None:
    """One thread per worker; the first error (not a transport failing because of it) is re-raised here."""
    world = len(transports)

    def work(rank: int) -> None:
        transport = transports[rank]
        try:
            Worker(job, rank=rank, world_size=world, transport=transport, show=show).run()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            job.outcome.failed(e)
            job.stops.at_once()
        finally:
            # Leaving the group releases the others from any collective that waits on this rank.
            if transport is not None:
                transport.close()

    threads = [
        threading.Thread(target=work, args=(r,), name=f"diloco-worker-{r}", daemon=True)
        for r in range(world)
    ]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.2)
    except KeyboardInterrupt:
        job.stops.at_once()
        for th in threads:
            th.join(30)
        raise
    cause = job.outcome.cause()  # the others are usually transports failing because of it
    if cause is not None:
        raise cause
