"""What a round hands back: ``PendingRound`` while its reduce is in flight, ``RoundReport`` once it ended."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .fragment import Settled
from .merge import LeftOut
from .transport import ReduceHandle, ReduceResult

__all__ = ["PendingRound", "RoundReport", "log_round", "report_of"]

logger = logging.getLogger("diloco_core.diloco")


@dataclass(frozen=True)
class PendingRound:
    """A round whose reduce is in flight (``DiLoCo.begin_round``); ``DiLoCo.finish_round`` completes it."""

    round: int
    """The round it completes (1 for the first)."""
    handle: ReduceHandle | None
    """None once ``settled`` (a round restored from a checkpoint has no reduce in flight)."""
    pseudo_grad_norm: float
    started: float
    """``time.perf_counter()`` when the round began."""
    buffers: ReduceHandle | None = None
    """The reduce of the model's floating-point buffers (``ModelState``), if it has any."""
    excluded: bool = False
    """This worker sent zeros instead of its pseudo-gradient (the contribution guard: not finite, or out of
    its wire's range)."""
    clipped: bool = False
    """The norm guard scaled this worker's pseudo-gradient down before it was sent."""
    fragment: int = 0
    """The fragment whose round this is (0 unless streaming)."""
    finish_at: int = 0
    """The inner step after which its outer step is applied (overlap: ``overlap_steps`` after it began)."""
    sent_norm: float = 0.0
    """The norm of what was sent (the guard may have clipped it), for a retry that sends it again."""
    work: float = 1.0
    """What this worker's contribution weighs (``Rounds.work``): 1 unless rounds end by time."""
    steps: int = 0
    """This worker's inner steps in the round."""
    settled: Settled | None = None
    """Its mean once in place, before the outer step (a checkpoint taken meanwhile settles it)."""


@dataclass(frozen=True)
class RoundReport:
    round: int
    """Index of the outer round that just finished (1 for the first)."""
    num_contributors: int
    """Workers that took part in the round's reduce (those the guard excluded included)."""
    bytes_sent: int
    bytes_received: int
    comm_seconds: float
    """Seconds from starting the all-reduce until its mean was in place."""
    round_seconds: float
    """Seconds for the whole round: pseudo-gradient, all-reduce, outer step, copy back."""
    pseudo_grad_norm: float = 0.0
    """L2 norm of this worker's pseudo-gradient (global - local) in this round."""
    mean_pseudo_grad_norm: float = 0.0
    """L2 norm of the mean pseudo-gradient, the "gradient" the outer optimizer stepped with."""
    agreement: float = 1.0
    """``mean_pseudo_grad_norm`` over the contributors' mean pseudo-gradient norm: 1 when every worker
    moved the same way, about 1/sqrt(M) when M workers' moves are unrelated, 0 when they cancel out
    (1 also when every worker's pseudo-gradient is zero). The contributors' norms ride in the round's
    own all-reduce (one extra value), so reading it costs no extra round trip."""
    valid_contributors: int = 0
    """Contributors whose pseudo-gradients were averaged: ``num_contributors`` minus those excluded. 0: no
    outer step was taken (the global params stayed as they were)."""
    excluded: bool = False
    """This worker's pseudo-gradient was left out of the mean (NaN, infinite, or out of the wire's range);
    it took the round's global params like every other worker."""
    clipped: bool = False
    """The norm guard (``DiLoCoConfig.norm_clip``) scaled this worker's pseudo-gradient down."""
    mean_clipped: bool = False
    """The norm guard scaled the round's mean down (the same on every worker)."""
    fragment: int = 0
    """The fragment this round synchronized (streaming; 0 otherwise)."""
    work: float = 1.0
    """What this worker's contribution weighed, in rounds of ``inner_steps`` steps (1 unless ``round_seconds``
    ends rounds by time: its steps / ``inner_steps``)."""
    total_work: float = 0.0
    """The valid contributions' summed work (``valid_contributors`` where every worker did ``inner_steps``
    steps): the mean is the work-weighted mean over them."""
    inner_steps: int = 0
    """This worker's inner steps in the round."""
    absent: tuple[str, ...] = ()
    """Members the round closed without (``ReduceResult.absent``: late, stalled or gone)."""
    grace_seconds: float = 0.0
    """Seconds the round waited, once it had its quorum, for the members still to come."""
    outliers: tuple[LeftOut, ...] = ()
    """Contributions the robust merge left out (``DiLoCoConfig.merge``), and by how much: who sent each (as the
    transport names contributors), its spread in median spreads and its lowest cosine with another. As far as
    this worker saw: all of them where it merged every payload, those of its own parts where members merge parts."""


def report_of(pending: PendingRound, *, round: int, mean_norm: float, mean_clipped: bool) -> RoundReport:
    """The report of ``pending`` once its outer step is taken (no reduce settled: eager's first boundary)."""
    settled = pending.settled or Settled(result=ReduceResult(0, 0, 0, 0.0), valid=0, contributors_norm=0.0)
    result, contributors_norm = settled.result, settled.contributors_norm
    return RoundReport(
        round=round,
        num_contributors=result.num_contributors,
        bytes_sent=result.bytes_sent,
        bytes_received=result.bytes_received,
        comm_seconds=result.seconds,
        round_seconds=time.perf_counter() - pending.started,
        pseudo_grad_norm=pending.pseudo_grad_norm,
        mean_pseudo_grad_norm=mean_norm,
        agreement=mean_norm / contributors_norm if contributors_norm > 0 else 1.0,
        valid_contributors=settled.valid,
        excluded=pending.excluded,
        clipped=pending.clipped,
        mean_clipped=mean_clipped,
        fragment=pending.fragment,
        work=pending.work,
        total_work=settled.work,
        inner_steps=pending.steps,
        absent=result.absent,
        grace_seconds=result.grace_seconds,
        outliers=result.left_out,
    )


def log_round(report: RoundReport) -> RoundReport:
    """The round's line at INFO, and a WARNING where the guard left a contribution out or clipped one."""
    logger.info(
        "round %d: %d contributors, %.1f MB sent, %.1f MB received, %.3fs comm, %.3fs round, "
        "|delta| %.4g, |mean delta| %.4g, agreement %.3f, %d steps (work %.3g of %.3g)",
        report.round,
        report.num_contributors,
        report.bytes_sent / 1e6,
        report.bytes_received / 1e6,
        report.comm_seconds,
        report.round_seconds,
        report.pseudo_grad_norm,
        report.mean_pseudo_grad_norm,
        report.agreement,
        report.inner_steps,
        report.work,
        report.total_work,
    )
    left_out = report.num_contributors - report.valid_contributors
    if report.excluded:
        logger.warning(
            "round %d: this worker's pseudo-gradient holds NaN, infinite or out-of-range values (its training "
            "diverged): left out of the mean; it continues from the round's global params",
            report.round,
        )
    elif left_out:
        n = report.num_contributors
        logger.warning("round %d: %d of %d contributions left out (not finite)", report.round, left_out, n)
    if report.valid_contributors == 0 and report.num_contributors:  # 0 contributors: eager's first boundary
        logger.warning("round %d: no valid contribution: no outer step, the global params are unchanged", report.round)
    far = [o for o in report.outliers if not o.why]
    if far:
        who = ", ".join(f"{o.who} ({o.ratio:.3g}x, cosine {o.cosine:.2f})" for o in far)
        logger.warning(
            "round %d: the robust merge left out %d of %d contributions, far from the centre of a majority and "
            "flipped or scaled by orders of magnitude (distance to the centre in median spreads, cosine with "
            "it): %s",
            report.round,
            len(far),
            report.num_contributors,
            who,
        )
    if len(far) < len(report.outliers):
        who = ", ".join(f"{o.who} ({o.why})" for o in report.outliers if o.why)
        logger.warning(
            "round %d: the merge corrected what an honest worker never sends, and names its sender: %s",
            report.round,
            who,
        )
    if report.absent:
        logger.warning(
            "round %d: closed without %s (late or gone: a contribution that comes later is dropped) after a %.2fs "
            "grace window",
            report.round,
            ", ".join(report.absent),
            report.grace_seconds,
        )
    if report.clipped or report.mean_clipped:
        what = " and ".join(w for w, on in (("this worker's", report.clipped), ("the mean", report.mean_clipped)) if on)
        logger.warning("round %d: the norm guard clipped %s pseudo-gradient", report.round, what)
    return report
