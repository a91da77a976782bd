"""The exchange of a round, every codec: payloads gathered, never a mean of an owner's making.

A block codec's payload cannot be cut anywhere, and a mean re-encoded by the part's owner would be
quantized twice. So the butterfly's parts are cut at codec blocks (``values_per_part``): the averaged
buffer holds fp32 values, each part is a block-aligned slice, and its payload (``codec.encode`` of the
slice) is a valid payload of those values, exactly the matching blocks of the whole contribution's.
Casts (fp32, fp16, bf16) travel the same way, their buffer in the wire dtype, each member's merge of a
part (in fp32) rounded to the wire dtype as the butterfly's owner did: the very same bits as the
butterfly, but no member takes a part's mean from its owner (an insider owner returned -100 times
its slice to everyone). The price: n - 1 payloads sent per member, against the butterfly's
2 (n - 1) / n (the same for 2 peers), and every member merges every part. With 3 or more peers every
relayed payload is checked against its sender's digest (``relay_check``) before the round commits.
Per part, every contributor sends the part's owner its payload; the owner sends each groupmate the
payloads of the *other* contributors (group order, concatenated), and every peer sums all the part's
payloads, its own included, merged (``Merge.of``) in group order: the very same fp32 mean on every
peer, never rounded again. With 2 peers this moves as many bytes as the butterfly (each peer sends one
whole payload); with n peers each sends n - 1 payloads, like an all-gather.

Everything received is checked before use: the shape and dtype of every message, and every payload
with ``codec.check`` (shape, dtype, finite non-negative scales).

Like ``reducer.Runner`` it overrides hivemind's private ``AllReduceRunner._generate_input_for_peer``,
``_communicate_with_peer`` and ``_accumulate_parts_streaming`` and reads private attributes of its
``TensorPartContainer``: check them against hivemind's before widening the pin (pyproject.toml).
"""

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter

from diloco_core import Codec

from .blame import ShortRelay
from .checks import check_payload, check_tensor
from .reducer import Runner, part_sum
from .relay_check import payload_digest

_NONE = runtime_pb2.CompressionType.NONE


def values_per_part(codec: Codec, part_size_bytes: int, *, values: int, members: int) -> int:
    """Values per butterfly part: whole blocks whose payload fits ``part_size_bytes`` (one block at
    least), and no more than a ``members``' share of the ``values``, so that every member that may own
    parts (not a client) owns one where the values allow: the blame (``blame.py``) needs every pair of
    them to exchange (with one owner, a failing sender and that owner blame each other and nobody else
    sees a thing; a client is judged by the owners alone)."""
    fits = max(1, part_size_bytes // codec.payload_bytes(codec.block))
    share = max(1, values // members // codec.block)
    return min(fits, share) * codec.block


async def _numbered(stream: Any) -> AsyncIterator[tuple[int, Any]]:
    index = 0
    async for msg in stream:
        yield index, msg
        index += 1


class BlockRunner(Runner):
    """``Runner`` for every codec (see the module docstring). The averaged tensor holds fp32 values
    (block codecs) or the wire dtype's (casts)."""

    def __init__(self, *, codec: Codec, part_size_bytes: int, **kwargs: Any) -> None:
        # hivemind cuts parts of part_size_bytes / itemsize values from the buffer (fp32 for block
        # codecs, the wire dtype for casts): whole blocks each.
        itemsize = (codec.elementwise_dtype or torch.float32).itemsize
        values = sum(t.numel() for t in kwargs["tensors"])
        members = len(kwargs["ordered_peer_ids"])
        vpp = values_per_part(codec, part_size_bytes, values=values, members=members)
        super().__init__(codec=codec, part_size_bytes=itemsize * vpp, **kwargs)
        self.codec = codec
        self.payload_dtype = codec.payload_spec(1)[1]
        self.me = self.ordered_peer_ids.index(self.peer_id)
        self.own: dict[
            tuple[int, int], torch.Tensor
        ] = {}  # my payload of each part, by (owner, part index)
        # 3 or more peers: an owner relays others' payloads, checked by their digests (relay_check)
        self.checks = len(self.ordered_peer_ids) > 2
        self.claims: dict[tuple[int, int], bytes] = {}  # my payloads' digests, by (owner, part)
        self.seen: dict[tuple[int, int, int], bytes] = {}  # (owner, part, sender): received digest

    def _encode(self, where: tuple[int, int]) -> torch.Tensor:
        """My payload of a groupmate's part ``where`` = (owner index, part index), kept to sum with the others'."""
        payload = self.codec.encode(self.inputs[where[0]][where[1]])
        self.own[where] = payload
        if self.checks:
            self.claims[where] = payload_digest(payload)
        return payload

    def _payload_numel(self, values: int) -> int:
        return self.codec.payload_spec(values)[0]

    async def _generate_input_for_peer(self, peer_index: int) -> Any:
        """My payload of every part the groupmate at ``peer_index`` owns, encoded in a thread as they go."""
        self.tensor_part_container._inputs_consumed_by_peer[peer_index] = (
            True  # hivemind's bookkeeping
        )

        def encode(part_index: int) -> runtime_pb2.Tensor:
            return serialize_torch_tensor(self._encode((peer_index, part_index)), _NONE)

        parts = as_aiter(*range(len(self.inputs[peer_index])))
        first = True
        async for serialized in amap_in_executor(
            encode, parts, max_prefetch=self.tensor_part_container.prefetch
        ):
            self.bytes_sent += len(serialized.buffer)
            if first:  # as hivemind's: the first message names the group
                msg = averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id
                )
            else:
                msg = averaging_pb2.AveragingData()
            msg.tensor_part.CopyFrom(serialized)
            msg.weight = self.weight
            yield msg
            first = False

    def _mean_from_others(self, where: tuple[int, int], msg: Any) -> tuple[int, int]:
        """Sum the other contributors' payloads of part ``where`` (one message) with mine, in group order,
        into the part itself; return (bytes received, ``part_sum`` of the mean). Runs in a thread."""
        index, part_index = where
        part = self.inputs[index][part_index]
        n, size = len(self.ordered_peer_ids), self._payload_numel(part.numel())
        got = deserialize_torch_tensor(msg.tensor_part)
        what = f"payloads of part {part_index} from {self.ordered_peer_ids[index]}"
        whole = got.dim() == 1 and got.dtype == self.payload_dtype and got.numel() % size == 0
        if whole and got.numel() < (n - 1) * size:  # the owner lacks a sender's payload (blame.py)
            raise ShortRelay(f"{what}: {got.numel() // size} payload(s) of {n - 1}")
        dtype = self.payload_dtype
        check_tensor(got, shape=((n - 1) * size,), dtype=dtype, what=what, finite=False)
        others = list(got.split(size))
        for p in others:
            self.codec.check(p, part.numel())
        if self.checks:  # the other senders' payloads as relayed (the owner's: its contribution)
            for sender, p in zip((i for i in range(n) if i != self.me), others):
                if sender != index:
                    self.seen[(index, part_index, sender)] = payload_digest(p)
        payloads = others[: self.me] + [self.own.pop(where)] + others[self.me :]
        start = self.starts[index][part_index]
        # casts: merged in fp32, then rounded to the wire dtype as the butterfly's owner did
        out = part if self.wire is None else torch.empty(part.numel())
        codec = self.codec
        self.left_out += self.merge.of(payloads, codec=codec, out=out, start=start, who=self.who)
        if out is not part:
            part.copy_(out)
        return got.numel() * got.element_size(), part_sum(part)

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        loop = asyncio.get_event_loop()
        if peer_id == self.peer_id:  # the parts I own: my payload goes straight to my reducer
            for part_index, part in enumerate(self.inputs[index]):
                payload = await loop.run_in_executor(None, self.codec.encode, part)
                # fp32: the values, which the mean replaces
                if payload.data_ptr() == part.data_ptr():
                    payload = payload.clone()  # while the relays to the others still read them
                mean, _ = await self.tensor_part_reducer.accumulate_part(
                    self.me, part_index, payload
                )
                part.copy_(mean)  # casts: rounded to the wire dtype
                self._register((index, part_index), part, part_sum(part))
            return
        try:
            self.injected_failure()
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(
                self._generate_input_for_peer(index)
            )
            want = container.num_parts_by_peer[index]

            # in an executor thread: part, message
            def receive(
                item: tuple[int, Any],
            ) -> tuple[int, int]:
                part_index, msg = item
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(
                        f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}"
                    )
                if part_index >= want:
                    raise AllreduceException(f"{peer_id} sent more parts than expected")
                return self._mean_from_others((index, part_index), msg)

            numbered = _numbered(aiter_with_timeout(stream, self.reducer_timeout))
            done = 0
            async for received, sum_ in amap_in_executor(
                receive, numbered, max_prefetch=container.prefetch
            ):
                self.bytes_received += received
                self._register((index, done), self.inputs[index][done], sum_)
                done += 1
            if done != want:
                raise AllreduceException(f"{peer_id} sent {done} parts, expected {want}")
        except BaseException as e:
            self._reducer_failed(peer_id, index, e)
            raise

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        """As the owner of my parts: take a sender's payload of each, answer with the others' payloads."""
        part_index = 0
        reducer, faults = self.tensor_part_reducer, self.faults
        numels = [s.numel() for s in reducer.part_shapes]
        try:
            self.injected_failure()
            loop = asyncio.get_event_loop()
            sender = self.sender_peer_ids[sender_index]

            # in an executor thread: part, message
            def receive(
                item: tuple[int, Any],
            ) -> torch.Tensor:
                k, msg = item
                if k >= len(numels):
                    raise AllreduceException("sender sent more parts than expected")
                payload = deserialize_torch_tensor(msg.tensor_part)
                what = f"payload of part {k} from {sender}"
                check_payload(payload, codec=self.codec, numel=numels[k], what=what)
                if self.checks:
                    self.seen[(self.me, k, sender_index)] = payload_digest(payload)
                return payload

            payloads = amap_in_executor(
                receive, _numbered(stream), max_prefetch=self.tensor_part_container.prefetch
            )
            async for payload in payloads:
                self.bytes_received += payload.numel() * payload.element_size()
                if faults.reducer_received_part is not None:
                    faults.reducer_received_part()
                try:
                    _, received = await reducer.accumulate_part(sender_index, part_index, payload)
                    part_index += 1
                except BannedException:
                    break
                others = [received[i] for i in sorted(received) if i != sender_index]
                if len(received) < len(self.ordered_peer_ids):  # a sender was banned: a short relay
                    self.short_relayed.add(self.sender_peer_ids[sender_index])
                if faults.relay_payloads is not None:
                    others = faults.relay_payloads(others, received[self.me])
                out = torch.cat(others)
                if faults.reducer_sends_mean is not None:
                    out = faults.reducer_sends_mean(out)
                serialized = await loop.run_in_executor(
                    None, functools.partial(serialize_torch_tensor, out, _NONE)
                )
                self.bytes_sent += len(serialized.buffer)
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=serialized
                )
        # a payload refused (its size, dtype, scales): why its sender is banned, in the round's report
        except ValueError as e:
            self.failures.append(str(e))
            raise
        finally:
            if part_index != reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
