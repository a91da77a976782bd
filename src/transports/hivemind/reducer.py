"""What the exchange of one group (phase 3 of a round) builds on: every peer owns one slice of the values.

``OrderedReducer`` keeps each sender's payload of a part and merges them in group order; ``Runner``
writes every mean part straight into the averaged tensors, records failures and fingerprints the
result for the confirmation (``averager.py``). The exchange itself is ``block_runner.BlockRunner``'s
(every codec: an owner relays the senders' payloads, never a mean of its own making).

They override hivemind's private ``AllReduceRunner._ban_sender``, and read private
attributes of its ``TensorPartContainer``: this is why pyproject.toml pins hivemind to the versions
tested (``>=1.1.10,<1.2``). Check these overrides against hivemind's before widening the pin.
"""

import asyncio
import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer

from diloco_core import FP32, MEAN, Codec, LeftOut, Merge

from .blame import ShortRelay
from .faults import HivemindFaults


def part_sum(t: torch.Tensor) -> int:
    """The part's bytes summed as 64-bit integers (wrapping; the last < 8 bytes added as one number).
    Exact and the same on every machine, one cheap pass over a part still in cache; any single changed
    value changes it (``Runner.digest`` combines the parts in order)."""
    t = t.detach().reshape(-1)
    if t.storage_offset() * t.element_size() % 8:
        t = t.clone()  # a 64-bit view needs an 8-byte aligned start
    b = t.view(torch.uint8)
    whole = b.numel() // 8 * 8
    total = int(b[:whole].view(torch.int64).sum()) if whole else 0
    return total + int.from_bytes(b[whole:].numpy().tobytes(), "little")


class OrderedReducer(TensorPartReducer):
    """Keeps every sender's part; once all arrived, they are merged (``Merge.of``) in group order (not arrival
    order): the same arithmetic as the transport contract's reference."""

    codec: Codec = FP32  # these set by the Runner (merge_with)
    merge: Merge = MEAN
    starts: Sequence[int] = ()
    """Where each of the parts this reducer merges begins in the averaged values."""
    who: Sequence[str] = ()
    left_out: list[LeftOut]

    def merge_with(
        self,
        *,
        codec: Codec,
        merge: Merge,
        starts: Sequence[int],
        who: Sequence[str],
        left_out: list[LeftOut],
    ) -> None:
        """How this reducer's parts are merged: ``codec``'s payloads by ``merge``, each part starting at ``starts``
        in the averaged values, contributors named by ``who``; what it leaves out is added to ``left_out``."""
        self.codec = codec
        self.merge = merge
        self.starts = starts
        self.who = who
        self.left_out = left_out

    def reset_accumulators(self) -> None:
        self.received: dict[int, torch.Tensor] = {}
        super().reset_accumulators()

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait(
                {self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED
            )
            if self.finished.is_set():
                raise AllreduceException("attempted to aggregate a part in a finalized reducer")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        future = self.current_part_future
        self.received[sender_index] = tensor_part  # every contributor weighs 1
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        """Once every sender's part is in: the future's result is (mean, the parts by sender index)."""
        if self.current_part_accumulated_from == self.num_current_senders:
            received = self.received
            senders = sorted(received)
            mean = self.accumulator
            self.left_out += self.merge.of(
                [received[i] for i in senders],
                codec=self.codec,
                out=mean,
                start=self.starts[self.current_part_index],
                who=[self.who[i] for i in senders],
            )
            self.current_part_future.set_result((mean, received))
            self.reset_accumulators()


class Runner(AllReduceRunner):
    """Records failures and writes every mean part straight into the averaged tensors (no final
    concatenation and copy); the exchange is ``block_runner.BlockRunner``'s."""

    def __init__(
        self, *, codec: Codec, merge: Merge, faults: HivemindFaults, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        # parts of an element-wise payload are payloads of the parts
        self.wire = codec.elementwise_dtype
        self.faults = faults
        self.failures: list[str] = []
        # the groupmates (peer ids) seen failing: a sender or a reducer (blame.py)
        self.blamed: set[Any] = set()
        self.short_relayed: set[Any] = set()  # the senders this peer relayed a short part to
        self.tensor_part_reducer.finished.set()  # replaced before use: keep its finalizer quiet
        self.tensor_part_reducer = OrderedReducer(
            self.tensor_part_reducer.part_shapes, len(self.sender_peer_ids)
        )
        container = self.tensor_part_container
        self.inputs = [
            [p for p, _ in parts] for parts in container._input_parts_by_peer
        ]  # views of the tensors
        self.merge = merge
        self.who = [str(p) for p in self.ordered_peer_ids]
        self.left_out: list[LeftOut] = []  # what the merges of the parts this peer reduced left out
        offsets = itertools.accumulate(
            (p.numel() for parts in self.inputs for p in parts), initial=0
        )
        flat = iter(offsets)  # hivemind cuts the values into consecutive parts, peer after peer
        self.starts = [[next(flat) for _ in parts] for parts in self.inputs]
        mine = self.starts[self.ordered_peer_ids.index(self.peer_id)]
        self.tensor_part_reducer.merge_with(
            codec=codec, merge=merge, starts=mine, who=self.who, left_out=self.left_out
        )
        self.part_sums: dict[tuple[int, int], int] = {}
        self.bytes_sent = self.bytes_received = (
            0  # the values' payloads this peer sent and received
        )
        container.iterate_output_tensors = self._outputs_in_place

    def _register(self, where: tuple[int, int], mean: torch.Tensor, sum_: int) -> None:
        """Record the mean of part ``where`` = (peer index, part index), whose ``part_sum`` is ``sum_``."""
        # Overwriting the input part is safe: its mean exists only once every groupmate's part (mine
        # included) has been summed, and mine was serialized before it was sent.
        self.part_sums[where] = sum_
        index, part_index = where
        part = self.inputs[index][part_index]
        if mean is not part:  # a block codec's mean is summed into the part itself
            part.copy_(mean)
        self.tensor_part_container.register_processed_part(index, part_index, part)

    async def _outputs_in_place(self) -> Any:
        """Replaces the container's ``iterate_output_tensors``: waits for every part, yields the tensors
        the parts were written into (a failed reducer's parts keep the local values, as in hivemind)."""
        container = self.tensor_part_container
        for i, expected in enumerate(container.num_parts_by_peer):
            while container._outputs_registered_by_peer[i] < expected:
                container._output_part_available[i].clear()
                await container._output_part_available[i].wait()
                if container.finished.is_set():
                    raise AllreduceException(
                        "all-reduce was terminated while waiting for its results"
                    )
        for t in container.local_tensors:
            yield t

    def owners(self) -> list[int]:
        """The members (group indices) that own parts: all but those of fraction 0 (clients)."""
        return [i for i, n in enumerate(self.tensor_part_container.num_parts_by_peer) if n]

    def digest(self) -> bytes:
        """A fingerprint of the exact bits of the result, from every part's sum in result order: a changed
        value changes its part's sum, a part in the wrong place changes the order. It is computed as the
        parts arrive (no extra pass over the result: a CRC-32 of 100 MB cost 46 ms per round here) and
        guards against accidental divergence among authenticated peers, not against forgery."""
        sums = [self.part_sums[k] for k in sorted(self.part_sums)]
        return hashlib.sha256(repr(sums).encode()).digest()[:16]

    def injected_failure(self) -> None:
        """``HivemindFaults.exchange_fails``: this peer's exchange fails (a sender's, a reducer's)."""
        fails = self.faults.exchange_fails
        if fails is not None and fails():
            raise AllreduceException("injected: this peer's part exchange fails")

    async def _ban_sender(self, peer_id: Any) -> None:
        """A sender that broke off after this peer relayed it a short part (lacking another sender's
        payload: ``ShortRelay``) is not blamed: it broke off because of that."""
        if peer_id not in self.banned_senders:
            self.failures.append(f"sender {peer_id} failed")
            if peer_id != self.peer_id and peer_id not in self.short_relayed:
                self.blamed.add(peer_id)
        await super()._ban_sender(peer_id)

    def _reducer_failed(self, peer_id: Any, index: int, e: BaseException) -> None:
        """Record that the reducer of slice ``index`` failed; hivemind fills the slice with local values,
        which the confirmation phase then never commits."""
        self.failures.append(f"reducer {peer_id} failed: {type(e).__name__}: {e}")
        if peer_id != self.peer_id and not isinstance(e, ShortRelay):  # a relay a sender failed
            self.blamed.add(peer_id)
        self.tensor_part_container.register_failed_reducer(index)
