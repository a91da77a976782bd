"""WAN transport over hivemind: a DHT to find peers, ``DecentralizedAverager`` groups to average.

Peers have no fixed ranks: whoever matchmakes within ``matchmaking_time`` forms the round's group.
One all-reduce (``HivemindTransport.all_reduce``) runs in phases:

1. matchmaking: a group forms; if none forms, the peer is alone: its own values, 1 contributor, logged.
   Meanwhile the fp32 values are rounded to the wire dtype into a flat buffer owned by a hivemind
   averager (one per (size, wire dtype), created on first use: hivemind fixes tensors at construction);
2. state check (for the all-reduce ``track_state`` names: DiLoCo's rounds): groupmates' state tags
   came with matchmaking; if they differ nothing is sent, peers holding the group's state retry
   without the others, and a peer that is behind takes the group's state (``StateReplaced``);
3. butterfly all-reduce: every peer reduces one slice, summing the wire values in fp32 *in group
   order* (``reference_mean``) and sending back the mean rounded to the wire dtype (not hivemind's
   compressed delta ``local + fp16(avg - local)``), so every participant holds the very same bits;
4. confirm: every peer sends (ok, digest of its result) to every groupmate. It commits only if all
   groupmates reported ok with its own digest; a lost peer or a partial all-reduce (hivemind fills a
   dead reducer's slice with local values) fails the attempt on every survivor, and the round is
   retried among the survivors until ``averaging_timeout + 4 * matchmaking_time`` has passed; after
   a failed attempt a peer never falls back to averaging alone (the others may regroup or give up);
5. on commit the mean is copied into the caller's tensors and the state tag advances; otherwise they
   are untouched and ``TransportError`` is raised, so DiLoCo keeps its state and the caller may retry.

Exact guarantee: the result is ``to_wire(sum_in_group_order(to_wire(x_i)) / n)`` widened to fp32 (for
fp32 the rounding is the identity), bit-identical on every contributor. Against
``diloco_core.wire.reference_mean`` it differs by the final rounding to the wire dtype (at most half
an ulp of the wire dtype) and, for 3 or more peers, by fp32 summation order.

``broadcast`` has no source rank: the run's first peer (started without ``initial_peers``) keeps its
values, a joining peer downloads them from any peer that already holds them (``src`` must be 0,
meaning "whoever holds the run's state"). Peers serve a snapshot taken at each broadcast and at the
start of each all-reduce (a point between rounds), plus whatever ``share_state`` adds (DiLoCo's
outer momentum and round: ``HivemindTransport.attach``, which ``DiLoCo`` calls).

Only peers that know the run's ``secret`` can take part: every DHT key and RPC namespace is derived
from HMAC-SHA256(secret, run_id). Nothing received is unpickled (protobuf and msgpack only) and every
received tensor is checked for shape, dtype and finite values before use.
"""

import concurrent.futures
import hashlib
import hmac
import logging
import re
import signal
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_core.config import check_field, is_finite_number
from diloco_core.transport import FutureHandle, ReduceHandle, ReduceResult, StateReplaced, Transport, TransportError
from diloco_core.wire import reference_mean, wire_torch_dtype

__all__ = ["HivemindConfig", "HivemindFaults", "HivemindTransport"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "the hivemind transport needs hivemind: pip install diloco[hivemind]"
# Held while this module forks a DHT or averager process. multiprocessing makes the pipe that tells a
# parent its child exited (the sentinel) just before forking; a fork from another thread in between
# copies that pipe into a second child, and the first child's join() then waits out hivemind's 5 s
# shutdown grace period for a child that has long exited (several transports in one process: tests).
_FORK_LOCK = threading.Lock()


@dataclass(frozen=True)
class HivemindFaults:
    """Faults for tests to inject, run in the averager processes (set before they are forked: pass them to
    ``HivemindTransport``). None is no fault."""

    reducer_received_part: Callable[[], None] | None = None
    """Called as this peer, acting as a reducer, has received (and checked) a part of a groupmate's values."""
    reducer_sends_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Replaces the mean part this peer, acting as a reducer, sends back to a groupmate."""


def _maddrs(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(a, str) and a.startswith("/") for a in value)


@dataclass(frozen=True, kw_only=True)
class HivemindConfig:
    run_id: str = "diloco"
    """Name of the run: peers with the same run_id (and secret) average together."""
    initial_peers: Sequence[str] = ()
    """Multiaddrs of peers already in the swarm (another peer's ``join_addresses``); empty starts a new swarm."""
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",)
    """Where to listen. The default takes every interface and a free port, as a WAN peer needs; use
    /ip4/127.0.0.1/tcp/0 for a single machine."""
    announce_maddrs: Sequence[str] = ()
    """Addresses to announce to others instead of the listened ones: the public address behind NAT."""
    matchmaking_time: float = 15.0
    """Seconds a peer waits for groupmates before each all-reduce (OpenDiLoCo's 15)."""
    averaging_timeout: float = 120.0
    """Seconds one all-reduce attempt may take once its group has formed."""
    min_group_size: int = 2
    """Smallest group worth averaging with; a peer that finds fewer averages alone (1 contributor)."""
    target_group_size: int | None = None
    """Peers expected in a round: a group starts as soon as this many have joined, without waiting out
    ``matchmaking_time``. Never below the number of peers: more peers than this form a second group,
    and one group's round is dropped when their members next meet. None: every round waits
    ``matchmaking_time`` for whoever comes."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret of the run: only peers that hold it can matchmake, average or download state.
    None makes an open swarm (logged as a warning)."""

    def __post_init__(self) -> None:
        check_field("run_id", self.run_id, isinstance(self.run_id, str) and self.run_id != "", "a non-empty string")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            value = getattr(self, name)
            check_field(name, value, _maddrs(value), "a list of multiaddrs such as /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
            object.__setattr__(self, name, tuple(value))
        check_field("host_maddrs", self.host_maddrs, len(self.host_maddrs) > 0, "at least one multiaddr")
        t = self.matchmaking_time
        check_field("matchmaking_time", t, is_finite_number(t) and t > 0, "a number of seconds > 0")
        t = self.averaging_timeout
        check_field("averaging_timeout", t, is_finite_number(t) and t > 0, "a number of seconds > 0")
        m = self.min_group_size
        check_field("min_group_size", m, isinstance(m, int) and not isinstance(m, bool) and m >= 1, "an integer >= 1")
        g = self.target_group_size
        ok = g is None or (isinstance(g, int) and not isinstance(g, bool) and g >= max(2, m))
        check_field("target_group_size", g, ok, f"none or an integer >= max(2, min_group_size) = {max(2, m)}")
        s = self.secret
        check_field("secret", "<hidden>" if s else s, s is None or (isinstance(s, str) and s != ""), "a non-empty string or none")


def _import_hivemind() -> Any:
    try:
        import hivemind
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return hivemind


def _namespace(run_id: str, secret: str | None) -> str:
    """The prefix of every DHT key and RPC name of the run; without the secret it cannot be guessed."""
    key = (secret or "").encode()
    return "diloco_" + hmac.new(key, run_id.encode(), hashlib.sha256).hexdigest()[:40]


def _part_sum(t: torch.Tensor) -> int:
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


def _checked(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` if all its values are finite (run in hivemind's executor threads, off the event loop)."""
    if t.is_floating_point() and t.numel() and not _finite(t):
        raise ValueError(f"{what}: holds non-finite values")
    return t


def _check_tensor(t: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, what: str, *, finite: bool = True) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{what}: got {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
    if finite:
        _checked(t, what)


def _finite(t: torch.Tensor) -> bool:
    """One pass, no temporary: min and max are NaN if any value is, and +-inf if any value is."""
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


_TAG_BYTES = 16


def _next_tag(tag: tuple[int, bytes], result_digest: bytes) -> tuple[int, bytes]:
    """The state tag after one more committed round: (rounds committed, hash chain of their results).
    Peers with equal tags applied the same results to the same start state, so they hold the same
    global state (the outer step is deterministic); no pass over the parameters is needed."""
    count, chain = tag
    return count + 1, hashlib.sha256(chain + result_digest).digest()[:_TAG_BYTES]


def _valid_tag(tag: Any) -> bool:
    return (isinstance(tag, (list, tuple)) and len(tag) == 2 and isinstance(tag[0], int) and tag[0] >= 0
            and isinstance(tag[1], bytes) and len(tag[1]) == _TAG_BYTES)  # fmt: skip


def _tag_or_none(serializer: Any, gathered: bytes) -> tuple[int, bytes] | None:
    """A groupmate's state tag from its matchmaking data (msgpack, checked); None if it sent none."""
    try:
        tag = serializer.loads(serializer.loads(gathered)[2])
    except Exception:  # malformed: treated as a peer with no (or a foreign) state
        return None
    return (tag[0], tag[1]) if _valid_tag(tag) else None


def _stale_verdict(tags: Sequence[tuple[int, bytes] | None], me: int) -> str | None:
    """None if every groupmate holds the same state tag. Otherwise the group's state is the tag with the
    most rounds (then the most holders, then the larger hash: the same choice on every peer), and the
    message tells this peer whether it is behind (it must re-sync) or a groupmate is."""
    if all(t == tags[0] for t in tags):
        return None
    held = Counter(t for t in tags if t is not None)
    group = max(held, key=lambda t: (t[0], held[t], t[1]))
    if tags[me] == group:
        return f"[stale:groupmate] {sum(t != group for t in tags)} groupmate(s) hold an older or diverged state"
    mine = "no state" if tags[me] is None else f"round {tags[me][0]}"
    return f"[stale:behind:{group[0]}:{group[1].hex()}] this peer's state ({mine}) differs from its group's (round {group[0]})"


@dataclass
class _Outcome:
    """What one reduce did to the caller's state, set under the transport's lock."""

    abandoned: bool = False
    """The caller's wait ran out: nothing may be copied into its tensors or state any more."""
    replaced: StateReplaced | None = None
    """The caller's state was replaced by the group's (set before the reduce's future completes)."""
    result: ReduceResult | None = None
    """The reduce committed (set with the commit, before the future completes)."""


class _Handle(FutureHandle):
    """Marks the reduce abandoned when the caller's wait times out, so a late result is never copied
    into tensors the caller has taken back (``_reduce`` checks the mark under the same lock)."""

    def __init__(self, future: concurrent.futures.Future, outcome: _Outcome, lock: threading.Lock) -> None:
        super().__init__(future, "hivemind all_reduce")
        self._outcome, self._lock = outcome, lock

    def wait(self, timeout: float) -> ReduceResult:
        try:
            return super().wait(timeout)
        except BaseException as e:  # a timeout, or Ctrl+C: nothing may be committed once the caller has left
            with self._lock:
                committed, replaced = self._outcome.result, self._outcome.replaced
                if committed is None and replaced is None:
                    self._outcome.abandoned = True
            if not isinstance(e, Exception):
                raise  # Ctrl+C still stops the caller
            if committed is not None:
                return committed  # it committed just as the wait ran out
            if replaced is not None:
                raise replaced from None  # the state was replaced just as the wait ran out
            raise


_classes: dict[str, type] = {}


def _averager_class() -> type:
    """``DecentralizedAverager`` with phases 3-4 of the module docstring (built once hivemind is imported)."""
    if "averager" in _classes:
        return _classes["averager"]
    import asyncio

    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
    from hivemind.averaging.partition import BannedException, TensorPartReducer
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2, runtime_pb2
    from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor

    class OrderedReducer(TensorPartReducer):
        """Keeps every sender's part; once all arrived, their mean is ``reference_mean`` of them in group
        order (not arrival order): the same arithmetic as the transport contract's reference."""

        def reset_accumulators(self) -> None:
            self.received: dict[int, torch.Tensor] = {}
            super().reset_accumulators()

        async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                                  weight: float = 1.0) -> torch.Tensor:  # fmt: skip
            self.num_parts_received[sender_index] += 1
            while part_index > self.current_part_index:
                await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
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
            if self.current_part_accumulated_from == self.num_current_senders:
                parts = [self.received[i] for i in sorted(self.received)]
                self.current_part_future.set_result(reference_mean(parts, self.wire_dtype, out=self.accumulator))
                self.reset_accumulators()

    class Runner(AllReduceRunner):
        """Returns the rounded mean itself (not a delta), checks what it receives, records failures, and
        writes every mean part straight into the averaged tensors (no final concatenation and copy)."""

        def __init__(self, *, wire_dtype: str, faults: HivemindFaults, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.wire = wire_torch_dtype(wire_dtype)
            self.faults = faults
            self.failures: list[str] = []
            self.tensor_part_reducer.finished.set()  # replaced before use: keep its finalizer quiet
            self.tensor_part_reducer = OrderedReducer(self.tensor_part_reducer.part_shapes, len(self.sender_peer_ids))
            self.tensor_part_reducer.wire_dtype = wire_dtype
            container = self.tensor_part_container
            self.inputs = [[p for p, _ in parts] for parts in container._input_parts_by_peer]  # views of the tensors
            self.expected = [[p.shape for p in parts] for parts in self.inputs]
            self.part_sums: dict[tuple[int, int], int] = {}
            container.iterate_output_tensors = self._outputs_in_place

        def _register(self, index: int, part_index: int, mean: torch.Tensor, part_sum: int) -> None:
            # Overwriting the input part is safe: its mean exists only once every groupmate's part (mine
            # included) has been summed, and mine was serialized before it was sent.
            self.part_sums[(index, part_index)] = part_sum
            part = self.inputs[index][part_index]
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
                        raise AllreduceException("all-reduce was terminated while waiting for its results")
            for t in container.local_tensors:
                yield t

        def digest(self) -> bytes:
            """A fingerprint of the exact bits of the result, from every part's sum in result order: a changed
            value changes its part's sum, a part in the wrong place changes the order. It is computed as the
            parts arrive (no extra pass over the result: a CRC-32 of 100 MB cost 46 ms per round here) and
            guards against accidental divergence among authenticated peers, not against forgery."""
            sums = [self.part_sums[k] for k in sorted(self.part_sums)]
            return hashlib.sha256(repr(sums).encode()).digest()[:16]

        async def _ban_sender(self, peer_id: Any) -> None:
            if peer_id not in self.banned_senders:
                self.failures.append(f"sender {peer_id} failed")
            await super()._ban_sender(peer_id)

        async def _communicate_with_peer(self, peer_id: Any) -> None:
            index = self.ordered_peer_ids.index(peer_id)
            container = self.tensor_part_container
            if peer_id == self.peer_id:
                me = self.sender_peer_ids.index(peer_id)
                for part_index, part in enumerate(self.parts_for_local_averaging):
                    mean = await self.tensor_part_reducer.accumulate_part(me, part_index, part)
                    mean = mean.to(self.wire)
                    self._register(index, part_index, mean, _part_sum(mean))
                return
            try:
                stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(self._generate_input_for_peer(index))

                def receive(msg: Any) -> tuple[torch.Tensor, int]:  # in an executor thread
                    if msg.code != averaging_pb2.AVERAGED_PART:
                        raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                    mean = _checked(deserialize_torch_tensor(msg.tensor_part), f"mean part from {peer_id}")
                    return mean, _part_sum(mean)

                part_index = 0
                async for mean, part_sum in amap_in_executor(receive, aiter_with_timeout(stream, self.reducer_timeout),
                                                             max_prefetch=container.prefetch):  # fmt: skip
                    if part_index >= len(self.expected[index]):
                        raise AllreduceException(f"{peer_id} sent more parts than expected")
                    _check_tensor(mean, self.expected[index][part_index], self.wire, f"mean part from {peer_id}", finite=False)
                    self._register(index, part_index, mean, part_sum)
                    part_index += 1
                if part_index != container.num_parts_by_peer[index]:
                    raise AllreduceException(f"{peer_id} sent {part_index} parts, expected {container.num_parts_by_peer[index]}")
            except BaseException as e:
                self.failures.append(f"reducer {peer_id} failed: {type(e).__name__}: {e}")
                container.register_failed_reducer(index)  # fills its slice with local values: never committed
                raise

        async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
            part_index = 0
            shapes = self.tensor_part_reducer.part_shapes
            try:
                loop = asyncio.get_event_loop()
                what = f"part from sender {sender_index}"
                async for part in amap_in_executor(lambda msg: _checked(deserialize_torch_tensor(msg.tensor_part), what),
                                                   stream, max_prefetch=self.tensor_part_container.prefetch):  # fmt: skip
                    if part_index >= len(shapes):
                        raise AllreduceException("sender sent more parts than expected")
                    _check_tensor(part, shapes[part_index], self.wire, what, finite=False)
                    if self.faults.reducer_received_part is not None:
                        self.faults.reducer_received_part()
                    try:
                        mean = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part)
                        part_index += 1
                    except BannedException:
                        break
                    out = mean.to(self.wire)
                    if self.faults.reducer_sends_mean is not None:
                        out = self.faults.reducer_sends_mean(out)
                    serialized = await loop.run_in_executor(None, serialize_torch_tensor, out, runtime_pb2.CompressionType.NONE)
                    yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
            finally:
                if part_index != self.tensor_part_reducer.num_parts:
                    await self._ban_sender(self.sender_peer_ids[sender_index])

    class Averager(DecentralizedAverager):
        """One flat buffer; the round's result replaces it only after the group confirmed one digest."""

        state_fn: Callable[[], tuple[Any, list[torch.Tensor]]] | None = None

        def __init__(self, *args: Any, wire_dtype: str, faults: HivemindFaults, **kwargs: Any) -> None:
            self.wire_dtype, self.faults = wire_dtype, faults
            self._confirms: OrderedDict[bytes, dict] = OrderedDict()
            self._groups: dict[bytes, dict] = {}  # per group id: its deadline, then its result's digest
            super().__init__(*args, **kwargs)

        def run(self) -> None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's: it closes us cleanly
            # The process's torch work is per-part (512 KB): one thread runs it faster than a pool whose
            # threads wait for each other (the checks' wall time in a 25M-value round was about twice as long).
            torch.set_num_threads(1)
            super().run()

        def get_current_state(self) -> tuple[Any, list[torch.Tensor], None]:
            fn = self.state_fn
            meta, tensors = fn() if fn is not None else ({"ready": False}, [])
            return meta, tensors, None

        async def _shutdown(self, timeout: float | None) -> None:
            try:
                await super()._shutdown(timeout)
            finally:  # hivemind leaves the replica's client socket in /tmp (one file per averager, never reused)
                if getattr(self, "_p2p", None) is not None:
                    await self._p2p.shutdown()

        async def rpc_confirm(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
            box = self._confirm_box(request.group_id)
            box["got"][context.remote_id] = (request.code == averaging_pb2.AVERAGED_PART, request.tensor_part.buffer)
            box["event"].set()
            return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)

        def _confirm_box(self, group_id: bytes) -> dict:
            if group_id not in self._confirms:
                self._confirms[group_id] = {"got": {}, "event": asyncio.Event()}
                while len(self._confirms) > 16:  # a peer only ever needs its latest groups
                    self._confirms.popitem(last=False)
            return self._confirms[group_id]

        async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
            tags = [_tag_or_none(self.serializer, g) for g in group_info.gathered]
            verdict = _stale_verdict(tags, group_info.peer_ids.index(self.peer_id))
            if verdict is not None:  # every groupmate reaches the same verdict: nobody sends anything
                raise AllreduceException(verdict)
            # Per group (a cancelled step may still be confirming while the next one starts).
            self._groups[group_info.group_id] = {"deadline": time.monotonic() + (self._allreduce_timeout or 60.0) - 0.5}
            try:
                await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
                return {"peers": [p.to_bytes() for p in group_info.peer_ids], "digest": self._groups[group_info.group_id]["digest"]}
            finally:
                self._groups.pop(group_info.group_id, None)

        async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any,
                                          group_id: bytes | None = None, **kwargs: Any) -> None:  # fmt: skip
            group_id = group_info.group_id if group_id is None else group_id
            runner = Runner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                            group_id=group_id, ordered_peer_ids=group_info.peer_ids, wire_dtype=self.wire_dtype,
                            faults=self.faults, **kwargs)  # fmt: skip
            self._running_groups[group_id].set_result(runner)
            error = None
            try:
                if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                    raise AllreduceException("auxiliary peers are not supported")
                async for _ in runner:  # the means land in `tensors` part by part (Runner._register)
                    pass
                if runner.failures:
                    error = "partial all-reduce: " + "; ".join(runner.failures[:3])
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            digest = b"" if error else runner.digest()
            await self._confirm(group_info, group_id, error, digest)
            self._groups[group_id]["digest"] = digest

        async def _confirm(self, group_info: Any, group_id: bytes, error: str | None, digest: bytes) -> None:
            others = [p for p in group_info.peer_ids if p != self.peer_id]
            code = averaging_pb2.AVERAGED_PART if error is None else averaging_pb2.INTERNAL_ERROR
            msg = averaging_pb2.AveragingData(code=code, group_id=group_id, tensor_part=runtime_pb2.Tensor(buffer=digest))
            group_deadline = self._groups[group_id]["deadline"]
            left = max(0.1, group_deadline - time.monotonic())

            async def send(peer: Any) -> bool:
                try:
                    await asyncio.wait_for(self.get_stub(self._p2p, peer, namespace=self.prefix).rpc_confirm(msg), left)
                    return True
                except Exception as e:  # a lost peer is seen by the receivers as a missing confirmation
                    logger.debug("confirm to %s failed: %r", peer, e)
                    return False

            sends = [asyncio.create_task(send(p)) for p in others]
            box = self._confirm_box(group_id)
            try:
                while error is None:
                    got = {p: v for p, v in box["got"].items() if p in others}  # only this group's members count
                    bad = [p for p, (ok, d) in got.items() if not ok or d != digest]
                    if bad:
                        error = f"{len(bad)} groupmate(s) failed or hold a different result"
                    elif all(p in got for p in others):
                        break
                    else:
                        box["event"].clear()
                        left = group_deadline - time.monotonic()
                        if left <= 0:
                            error = f"{sum(p not in got for p in others)} groupmate(s) never confirmed the result"
                            break
                        try:
                            await asyncio.wait_for(box["event"].wait(), left)
                        except asyncio.TimeoutError:
                            pass
            finally:
                delivered = await asyncio.gather(*sends, return_exceptions=True)
                self._confirms.pop(group_id, None)
            if error is None and not all(d is True for d in delivered):
                # A groupmate that did not get my confirmation will not commit; neither may I.
                error = f"{sum(d is not True for d in delivered)} confirmation(s) could not be delivered"
            if error is not None:
                raise AllreduceException(f"round not committed: {error}")

    _classes["averager"] = Averager
    _classes["AllreduceException"] = AllreduceException
    return Averager


def _retryable() -> tuple[type, ...]:
    """What a group attempt raises when peers or the network fail: worth another attempt."""
    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.p2p import P2PDaemonError, P2PHandlerError

    return AllreduceException, MatchmakingException, P2PDaemonError, P2PHandlerError, TimeoutError, concurrent.futures.CancelledError


def _wait_until_ready(process: Any, what: str, timeout: float = 60.0) -> None:
    try:
        process.wait_until_ready(timeout)
    except concurrent.futures.TimeoutError:
        raise TransportError(f"hivemind: the {what} process did not start within {timeout:g}s") from None


@dataclass
class _Resources:
    """What ``close`` releases; kept apart from the transport so that a finalizer can hold it."""

    dht: Any = None
    averagers: list = field(default_factory=list)
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for averager in self.averagers:  # averagers first: they use the DHT's p2p daemon
            try:
                if averager.is_alive():
                    averager.shutdown()
            except Exception as e:  # keep closing the rest
                logger.warning("hivemind averager did not shut down cleanly: %r", e)
        if self.dht is not None:
            try:
                if self.dht.is_alive():
                    self.dht.shutdown()
                    self.dht.join(10)
            except Exception as e:
                logger.warning("hivemind DHT did not shut down cleanly: %r", e)


class HivemindTransport(Transport):
    """A peer of a hivemind swarm (see the module docstring for the phases of a round)."""

    def __init__(self, config: HivemindConfig, *, faults: HivemindFaults | None = None, part_size_bytes: int = 2**19) -> None:
        """``faults``: for tests, faults to inject. ``part_size_bytes``: the size of the parts the values
        travel in (hivemind's default; tests make it small to get many parts per all-reduce)."""
        hivemind = _import_hivemind()
        if not isinstance(part_size_bytes, int) or isinstance(part_size_bytes, bool) or part_size_bytes < 1:
            raise ValueError(f"part_size_bytes={part_size_bytes!r} is invalid: expected an integer >= 1")
        self.config = config
        self._faults, self._part_size_bytes = faults or HivemindFaults(), part_size_bytes
        self._ns = _namespace(config.run_id, config.secret)
        if config.secret is None:
            logger.warning("hivemind run %r has no secret: anyone who knows the run_id can join and average", config.run_id)
        self._joining = bool(config.initial_peers)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._lock = threading.RLock()  # re-entered: a re-sync loads DiLoCo, whose state_dict() reads the tags
        self._averagers: dict[tuple[int, str], Any] = {}
        self._shared: list[list[torch.Tensor]] = []  # the tensors of every broadcast, in call order
        self._extra_fn: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None
        self._snapshot: tuple[dict, list[torch.Tensor]] = ({"ready": False}, [])
        self._downloaded: tuple[dict, list[torch.Tensor]] | None = None
        self._last_group: list[bytes] = []
        self._tracked_key: tuple[int, str] | None = None  # the all-reduce whose results make up the state
        self._tag: tuple[int, bytes] = (0, bytes(_TAG_BYTES))
        self._prev_tag: tuple[int, bytes] | None = None  # the tag before the last commit
        self._on_resync: Callable[[dict, list[torch.Tensor]], Callable[[], None]] | None = None
        self._closed = False
        try:
            with _FORK_LOCK:
                self._res.dht = hivemind.DHT(
                    initial_peers=list(config.initial_peers), start=False, host_maddrs=list(config.host_maddrs),
                    announce_maddrs=list(config.announce_maddrs) or None,
                )  # fmt: skip
                self._res.dht.start()
            _wait_until_ready(self._res.dht, "DHT")
            # A 1-value averager that never averages: it serves this peer's state to joiners (a joiner
            # only once it holds the run's state).
            self._state_averager = self._make_averager(1, "fp32", prefix=f"{self._ns}_state", share=not self._joining)
            self._state_averager.state_fn = self._serve_state
            self._res.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hivemind-transport")
        except BaseException:
            self._res.close()
            raise
        self.join_addresses: list[str] = [str(a) for a in self._res.dht.get_visible_maddrs()]
        """Multiaddrs to pass as ``initial_peers`` to peers that should join this one's swarm."""
        logger.info("hivemind peer up; others join with initial_peers = %s", self.join_addresses)

    # -- membership --------------------------------------------------------------------------------

    fixed_ranks = False  # whoever matchmakes in time forms a round's group

    def attach(self, diloco: Any, timeout: float) -> bool:
        """Take the run's outer momentum and round from the peers (a joiner; False on the swarm's first
        peer), then serve this peer's to later joiners and re-sync it when a round finds it behind."""
        if self._on_resync is not None:
            raise ValueError("this HivemindTransport already serves a DiLoCo: use one transport per DiLoCo")
        joined = _load_diloco_state(self, diloco, timeout)
        _share_diloco_state(self, diloco)
        return joined

    def state_dict(self) -> dict:
        """The state tag (and the one before it), so that a peer resumed from a checkpoint is compared
        with its group by the rounds it really holds, not as a fresh start."""
        with self._lock:
            return {"tag": self._tag, "prev_tag": self._prev_tag}

    def load_state_dict(self, state: dict) -> None:
        """Take back the tags of a checkpoint (DiLoCo's state is in place by now) and serve that state."""
        tag, prev = state.get("tag"), state.get("prev_tag")
        if not _valid_tag(tag) or not (prev is None or _valid_tag(prev)):
            raise ValueError(f"hivemind transport state holds no valid state tag: {state!r}")
        with self._lock:
            self._tag = (int(tag[0]), bytes(tag[1]))
            self._prev_tag = None if prev is None else (int(prev[0]), bytes(prev[1]))
        self._take_snapshot()  # joiners now get the loaded state, not the one from before it

    @property
    def rank(self) -> int:
        """This peer's index in its last group (peers have no fixed rank; 0 before the first round)."""
        me = self._res.dht.peer_id.to_bytes() if self._res.dht is not None else b""
        return self._last_group.index(me) if me in self._last_group else 0

    @property
    def world_size(self) -> int:
        """Size of the last group this peer averaged in (1 before the first round)."""
        return max(1, len(self._last_group))

    # -- averaging -----------------------------------------------------------------------------------

    def _make_averager(self, size: int, wire_dtype: str, *, prefix: str, share: bool = False) -> Any:
        cfg = self.config
        dtype = wire_torch_dtype(wire_dtype)
        request_timeout = min(3.0, cfg.matchmaking_time / 3)
        averager = _averager_class()(
            [torch.zeros(size, dtype=dtype)], self._res.dht, start=False, prefix=prefix, wire_dtype=wire_dtype,
            min_group_size=cfg.min_group_size, target_group_size=cfg.target_group_size,
            min_matchmaking_time=cfg.matchmaking_time,
            request_timeout=request_timeout, allreduce_timeout=cfg.averaging_timeout,
            next_chunk_timeout=cfg.averaging_timeout / 4, part_size_bytes=self._part_size_bytes, faults=self._faults,
            allow_state_sharing=share, declare_state_period=max(5.0, cfg.matchmaking_time),
        )  # fmt: skip
        # Started by hand: hivemind's run_in_background would make *this* process ignore Ctrl+C
        # (and fails outside the main thread); the child ignores SIGINT itself (Averager.run).
        with _FORK_LOCK:
            averager.start()
        self._res.averagers.append(averager)
        _wait_until_ready(averager, "averager")
        return averager

    def _averager(self, size: int, wire_dtype: str) -> Any:
        key = (size, wire_dtype)
        if key not in self._averagers:
            self._averagers[key] = self._make_averager(size, wire_dtype, prefix=f"{self._ns}_{wire_dtype}_{size}")
        return self._averagers[key]

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, wire_dtype: str = "fp32") -> ReduceHandle:
        dtype = wire_torch_dtype(wire_dtype)  # every wire dtype is honoured: it picks the averager
        tensors = list(tensors)
        if not tensors:
            raise ValueError("all_reduce needs at least one tensor")
        for t in tensors:
            if t.dtype != torch.float32:
                raise ValueError(f"all_reduce takes fp32 tensors, got {t.dtype}")
        if self._closed:
            raise TransportError("hivemind transport is closed")
        # A point between rounds: what joiners download. A joiner that takes it while this round is in
        # flight trains from it and meets this round's group if it matchmakes in time (tested); telling
        # joiners to wait instead made them miss the round and average a round behind.
        self._take_snapshot()
        self._averager(sum(t.numel() for t in tensors), wire_dtype)  # created here: it starts a process
        # The caller's tensors are the contribution (untouched until commit, so a retry re-reads them).
        outcome = _Outcome()
        future = self._res.pool.submit(self._reduce, tensors, wire_dtype, dtype, outcome)
        return _Handle(future, outcome, self._lock)

    def _reduce(self, tensors: list[torch.Tensor], wire_dtype: str, dtype: torch.dtype,
                outcome: _Outcome) -> ReduceResult:  # fmt: skip
        start = time.perf_counter()
        cfg = self.config
        numels = [t.numel() for t in tensors]
        averager = self._averager(sum(numels), wire_dtype)
        tracked = (sum(numels), wire_dtype) == self._tracked_key  # DiLoCo's rounds: groupmates compare state tags
        # Room for one failed attempt (up to averaging_timeout after matchmaking) and a regroup.
        deadline = time.monotonic() + cfg.averaging_timeout + 4 * cfg.matchmaking_time
        n_bytes = sum(numels) * dtype.itemsize
        attempt = 0
        failed: Exception | None = None  # set once a group attempt failed
        while True:
            attempt += 1
            if self._res.closed or not averager.is_alive():  # step() would wait for a dead process forever
                raise TransportError("hivemind all_reduce: the transport was closed (or its averager died)")
            try:
                # Matchmaking starts first and the contribution is copied in while it runs (a group that forms
                # sooner waits for the trigger). Bounded even if the averager's process dies mid-step.
                control = averager.step(gather=list(self._tag) if tracked else None, timeout=2 * cfg.matchmaking_time,
                                        allow_retries=False, wait=False, require_trigger=True)  # fmt: skip
                try:
                    with averager.get_tensors() as (buf,):  # rounded to the wire dtype on the way in
                        for v, t in zip(buf.split(numels), tensors):  # plain copies: foreach_copy_ is 5x slower on CPU
                            v.copy_(t.detach().reshape(-1))
                    control.allow_allreduce()
                    out = self._wait(control, 2 * cfg.matchmaking_time + cfg.averaging_timeout + 10)
                except BaseException:
                    if not control.done():
                        control.cancel()
                    raise
            except Exception as e:
                if self._res.closed:
                    raise TransportError("hivemind transport was closed during an all_reduce") from e
                if not isinstance(e, _retryable()):  # a bug or a setup error: retrying would only delay it
                    raise TransportError(f"hivemind all_reduce failed: {type(e).__name__}: {e}") from e
                out = None
                behind = re.search(r"\[stale:behind:(\d+):([0-9a-f]+)\]", str(e))
                if behind:  # nothing moved; my state is older than my group's: take theirs
                    self._resync((int(behind.group(1)), bytes.fromhex(behind.group(2))), outcome)
                if "[stale:groupmate]" in str(e):  # nothing moved: retry without the stale peer(s), alone if need be
                    if deadline - time.monotonic() < cfg.matchmaking_time:
                        raise TransportError(f"hivemind all_reduce: {e}") from e
                    logger.warning("hivemind all_reduce attempt %d: %s; retrying without them", attempt, e)
                    continue
                if "could not find a group" not in str(e):
                    failed = e
            if out is None and failed is not None:
                # After a failed group attempt a survivor never commits alone: another survivor may be
                # retrying or giving up, and only a new group (or a failure on all of them) stays consistent.
                if deadline - time.monotonic() < cfg.matchmaking_time:
                    raise TransportError(f"hivemind all_reduce failed after {attempt} attempt(s): {failed}") from failed
                logger.warning("hivemind all_reduce attempt %d failed (%s); retrying among the survivors", attempt, failed)
                continue
            if out is None:  # nobody to average with: my own values, as OpenDiLoCo
                logger.warning("hivemind all_reduce: no group formed within %.1fs; averaging alone", 2 * cfg.matchmaking_time)
                n, sent, self._last_group = 1, 0, []
            else:
                n, self._last_group = len(out["peers"]), list(out["peers"])
                sent = 2 * (n - 1) * n_bytes // n  # butterfly: my parts out, my slice's means back
            # Alone, the buffer holds my own values rounded to the wire, like every contributor's.
            with self._lock, averager.get_tensors() as (buf,):
                if outcome.abandoned:  # the caller timed out and may be retrying with these tensors
                    raise TransportError("hivemind all_reduce finished after its caller had given up")
                for r, t in zip(buf.split(numels), tensors):
                    t.copy_(r.view_as(t))
                if tracked:  # alone, my state leaves the group's: my own mark, never equal to theirs
                    me = self._res.dht.peer_id.to_bytes()
                    self._prev_tag = self._tag
                    self._tag = _next_tag(self._tag, out["digest"] if out is not None else b"alone:" + me)
                outcome.result = ReduceResult(n, sent, sent, time.perf_counter() - start)
            return outcome.result

    def _wait(self, future: Any, timeout: float) -> Any:
        """``future.result(timeout)``, but given up within a second of ``close()``: the thread waiting here
        is joined by the interpreter at exit, and a Ctrl+C should not wait for a step's or download's
        timeout (nor forever, for a process that close() has shut down)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if self._res.closed:
                    raise TransportError("hivemind transport was closed") from None
                if time.monotonic() >= deadline:
                    raise

    # -- state for joiners ---------------------------------------------------------------------------

    def share_state(self, get_state: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        """Also serve ``get_state() -> (msgpack-able dict, tensors)`` to joiners; it is called at the start
        of every all_reduce (between rounds), so it should return tensors that are not changed in place."""
        self._extra_fn = get_state
        self._take_snapshot()

    def load_state(self, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """The state a peer shared with ``share_state`` (downloaded with the broadcast values on joining);
        None when this peer started the swarm."""
        if not self._joining:
            return None
        if self._downloaded is None:
            self._downloaded = self._download(timeout)
        meta, tensors = self._downloaded
        skip = sum(meta["broadcasts"])
        return meta["extra"], tensors[skip:]

    def _take_snapshot(self) -> None:
        if self._joining and self._downloaded is None:
            return  # a joiner serves nothing until it holds the run's state
        extra_meta, extra = self._extra_fn() if self._extra_fn is not None else ({}, [])
        tensors = [t.detach().clone() for group in self._shared for t in group] + [t.detach().clone() for t in extra]
        counts = [len(g) for g in self._shared]
        meta = {"ready": True, "broadcasts": counts, "extra": extra_meta, "num_tensors": len(tensors)}
        with self._lock:
            meta["tag"] = list(self._tag) if self._tracked_key is not None else None
            meta["prev_tag"] = list(self._prev_tag) if self._tracked_key is not None and self._prev_tag else None
            self._snapshot = (meta, tensors)

    def _serve_state(self) -> tuple[dict, list[torch.Tensor]]:
        with self._lock:
            return self._snapshot

    def _download(self, timeout: float) -> tuple[dict, list[torch.Tensor]]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                # One try may take all the time left (a large state over a slow link); a stalled donor is
                # caught by hivemind's per-chunk timeout, and a try that outlives its time is cancelled.
                future = self._state_averager.load_state_from_peers(wait=False, timeout=max(1.0, left))
                try:
                    got = self._wait(future, max(1.0, left) + 5)
                except BaseException:
                    if not future.done():
                        future.cancel()
                    raise
            except Exception as e:  # a timeout or a peer that vanished: try again
                if self._res.closed:
                    raise TransportError("hivemind transport was closed during a state download") from e
                logger.debug("state download failed: %r", e)
                got = None
            if got is not None:
                meta, tensors = got
                if _valid_state(meta, tensors):
                    return meta, tensors
                logger.warning("ignored an invalid or not yet ready state from a peer")
            if time.monotonic() + 1.0 > deadline:
                raise TransportError(
                    f"hivemind: no peer of run {self.config.run_id!r} served its state within {timeout:g}s "
                    "(are initial_peers right, and do all peers use the same secret?)"
                )
            time.sleep(1.0)

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int = 0, timeout: float) -> None:
        """Make ``tensors`` the run's values: kept on the swarm's first peer, downloaded on a joiner."""
        if src != 0:
            raise ValueError(f"src={src!r} is invalid: hivemind peers have no ranks; src=0 means whoever holds the run's state")
        tensors = list(tensors)
        index = len(self._shared)
        if self._joining:
            deadline = time.monotonic() + timeout
            if self._downloaded is None:
                self._downloaded = self._download(timeout)
            while index >= len(self._downloaded[0]["broadcasts"]) and time.monotonic() + 1.0 < deadline:
                time.sleep(1.0)  # the donor has not made this broadcast yet (it may still be starting)
                self._downloaded = self._download(deadline - time.monotonic())
            torch._foreach_copy_(tensors, _broadcast_values(self._downloaded, index, tensors))
            self._state_averager.allow_state_sharing = True
        self._shared.append(tensors)
        self._take_snapshot()

    # -- stale or diverged state ------------------------------------------------------------------------

    def track_state(self, numel: int, wire_dtype: str, on_resync: Callable[[dict, list[torch.Tensor]], Callable[[], None]]) -> None:
        """Declare the all-reduce of ``numel`` values on ``wire_dtype`` as the one whose results make up the
        run's state (DiLoCo's rounds; ``_share_diloco_state`` calls this). From then on groupmates compare
        state tags before averaging: a peer that is behind or has diverged takes its group's state
        instead and its ``all_reduce`` raises ``StateReplaced``. ``on_resync(extra meta, extra tensors)``
        checks what ``share_state`` served and returns the function that loads it (called after the
        broadcast values are in place), so that a state that does not fit changes nothing."""
        with self._lock:
            self._tracked_key, self._on_resync = (numel, wire_dtype), on_resync
        self._take_snapshot()

    def adopt_downloaded_tag(self) -> None:
        """On a joiner, once it has loaded the state it downloaded: take that state's tag too. Until then it
        serves the initial tag, which no group holds, so nobody re-syncs from its half-loaded state."""
        meta = self._downloaded[0] if self._downloaded is not None else {}
        with self._lock:
            if meta.get("tag") is not None:
                self._tag = (meta["tag"][0], meta["tag"][1])
                self._prev_tag = tuple(meta["prev_tag"]) if meta.get("prev_tag") is not None else None
        self._take_snapshot()

    def _resync(self, group_tag: tuple[int, bytes], outcome: _Outcome) -> None:
        """Replace this peer's state with its group's, then raise ``StateReplaced``. The group is retrying
        this round without us, so wait (within one round's time) for the state it commits, whose previous
        tag is ``group_tag``: taking the group's current one would leave us a round behind again. A state
        with any other history (a peer that is stale or diverged itself) is never taken."""
        if self._on_resync is None:
            raise TransportError("hivemind: this peer's state is older than its group's and nothing can reload it")
        cfg = self.config
        deadline = time.monotonic() + cfg.averaging_timeout + 4 * cfg.matchmaking_time
        want, best = list(group_tag), None
        while not (self._res.closed or outcome.abandoned):
            try:
                got = self._download(max(1.0, deadline - time.monotonic()))
            except TransportError:
                got = None
            if got is not None and got[0].get("prev_tag") == want:
                best = got  # the round the group is finishing
                break
            if got is not None and got[0].get("tag") == want:
                best = got  # the group's state now: taken if the newer one does not come in time
            if time.monotonic() + 1.0 > deadline:
                break
            time.sleep(1.0)
        if best is None:
            raise TransportError(f"hivemind: this peer is behind its group (round {group_tag[0]}) and no peer served that state")
        meta, got = best
        # Everything is checked before anything changes.
        values = [_broadcast_values(best, index, tensors) for index, tensors in enumerate(self._shared)]
        load_extra = self._on_resync(meta["extra"], got[sum(meta["broadcasts"]) :])
        with self._lock:
            if outcome.abandoned or self._res.closed:
                raise TransportError("hivemind: re-sync finished after the caller had given up")
            for tensors, v in zip(self._shared, values):
                torch._foreach_copy_(tensors, v)
            load_extra()
            self._tag, self._downloaded = (meta["tag"][0], meta["tag"][1]), best
            self._prev_tag = tuple(meta["prev_tag"]) if meta.get("prev_tag") is not None else None
            outcome.replaced = StateReplaced(f"this peer was behind its group; it took the group's state of round {meta['tag'][0]}")
        self._take_snapshot()
        logger.warning("hivemind: %s", outcome.replaced)
        raise outcome.replaced

    def close(self) -> None:
        """Shut down the averagers, then the DHT and its p2p daemon. Idempotent."""
        self._closed = True
        self._finalizer()


def _broadcast_values(downloaded: tuple[dict, list[torch.Tensor]], index: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values of broadcast #``index`` in a downloaded state, checked against the local tensors."""
    meta, got = downloaded
    counts = meta["broadcasts"]
    if index >= len(counts) or counts[index] != len(like):
        raise TransportError(f"hivemind broadcast #{index}: the peers' state holds no matching broadcast ({counts})")
    values = got[sum(counts[:index]) : sum(counts[: index + 1])]
    try:
        for t, v in zip(like, values):
            _check_tensor(v, t.shape, t.dtype, f"broadcast #{index}")
    except ValueError as e:
        raise TransportError(f"hivemind broadcast #{index}: peers' values do not fit: {e}") from None
    return values


def _valid_state(meta: Any, tensors: Any) -> bool:
    if not isinstance(meta, dict) or meta.get("ready") is not True:
        return False
    counts, extra = meta.get("broadcasts"), meta.get("extra")
    if not isinstance(counts, list) or not all(isinstance(c, int) and c >= 0 for c in counts) or not isinstance(extra, dict):
        return False
    if any(meta.get(k) is not None and not _valid_tag(meta[k]) for k in ("tag", "prev_tag")):
        return False
    # A download cut short can arrive with fewer tensors than were served: never use part of a state.
    if not isinstance(tensors, list) or len(tensors) < sum(counts) or len(tensors) != meta.get("num_tensors"):
        return False
    return all(isinstance(t, torch.Tensor) and (not t.is_floating_point() or not t.numel() or _finite(t)) for t in tensors)


# -- DiLoCo's outer state for joiners (public DiLoCo API only) -----------------------------------------


def _share_diloco_state(transport: HivemindTransport, diloco: Any) -> None:
    """Serve ``diloco``'s outer momentum and round to joiners (the global params travel by broadcast),
    and let the transport re-sync ``diloco`` when a round finds it behind its group (``track_state``).

    The snapshot joiners download is refreshed right after every outer step (a torch optimizer
    post-hook), so a joiner gets the round that just finished, not the one before it."""

    stepped = [0]  # 1 while the outer step has run but DiLoCo has not yet counted the round

    def get_state() -> tuple[dict, list[torch.Tensor]]:
        state = diloco.state_dict()
        buffers = [s["momentum_buffer"] for s in state["outer_optimizer"]["state"].values() if s.get("momentum_buffer") is not None]
        return {"round": diloco.round + stepped[0], "num_momentum": len(buffers)}, [b.detach().clone() for b in buffers]

    def after_outer_step(*_: Any) -> None:
        # The newest consistent state: global params and momentum of the round that just finished.
        stepped[0] = 1
        try:
            transport._take_snapshot()
        finally:
            stepped[0] = 0

    transport.share_state(get_state)
    diloco.outer_optimizer.register_step_post_hook(after_outer_step)
    transport.track_state(diloco.reduce_numel, diloco.config.wire_dtype, lambda meta, tensors: _outer_state_loader(diloco, meta, tensors))


def _load_diloco_state(transport: HivemindTransport, diloco: Any, timeout: float) -> bool:
    """On a joiner, take the outer momentum and round the peers shared; False on the swarm's first peer."""
    got = transport.load_state(timeout)
    if got is None:
        return False
    meta, tensors = got
    if not meta:
        logger.warning("the peers shared no DiLoCo state (they broadcast without a DiLoCo): keeping round and momentum")
        return False
    _outer_state_loader(diloco, meta, tensors)()
    transport.adopt_downloaded_tag()  # and serve what was just loaded, not the state from before it
    return True


def _outer_state_loader(diloco: Any, meta: dict, tensors: list[torch.Tensor]) -> Callable[[], None]:
    """Check shared outer momentum and round against ``diloco``; return the function that loads them.
    Loading makes the model its global params (set by then from the peers' broadcast values)."""
    n = meta.get("num_momentum")
    rnd = meta.get("round")
    if not isinstance(n, int) or not isinstance(rnd, int) or rnd < 0 or len(tensors) != n:
        raise TransportError(f"hivemind: peers shared a DiLoCo state that does not fit ({meta})")
    keys = list(diloco.outer_optimizer.state_dict()["param_groups"][0]["params"])
    if n not in (0, len(keys)):
        raise TransportError(f"hivemind: peers shared {n} momentum buffers for {len(keys)} outer parameter(s)")
    like = diloco.state_dict()["global"]
    try:
        for t in tensors:
            _check_tensor(t, like.shape, torch.float32, "outer momentum")
    except ValueError as e:
        raise TransportError(f"hivemind: peers' outer momentum does not fit: {e}") from None

    def load() -> None:
        state = diloco.state_dict()
        del state["transport"]  # the caller sets the tag of what it loads
        state["model"] = [p.detach() for p in diloco.global_params]  # after a round the model is the global copy
        outer = state["outer_optimizer"]
        outer["state"] = {k: {"momentum_buffer": t.clone()} for k, t in zip(keys, tensors)}  # none before round 1
        state["round"] = rnd
        state["inner_step"] = rnd * diloco.config.inner_steps
        diloco.load_state_dict(state)

    return load
