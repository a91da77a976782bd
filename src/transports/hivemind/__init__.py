"""WAN transport over hivemind: a DHT to find peers, ``DecentralizedAverager`` groups to average.

Peers have no fixed ranks: whoever matchmakes within ``matchmaking_time`` forms the round's group.
One all-reduce (``HivemindTransport.all_reduce``) runs in phases:

1. matchmaking: a group forms, ending as soon as the peers this reduce expects are in (``swarm``: the
   live peers, from their presence in the DHT; or ``target_group_size``); a peer that expects nobody skips
   matchmaking. If no group forms, the peer is alone: its own values, 1 contributor, logged. With a
   ``quorum`` (``grace``), a round's matchmaking lasts a grace window adapted to the peers' arrival spread,
   and a group of at least the quorum closes then; a peer that arrives after its round closed takes that
   round's state instead (``attempts``).
   Meanwhile the fp32 values are copied into a flat buffer owned by a hivemind averager (one per reduce
   key, size and codec, created on first use: hivemind fixes tensors at construction), rounded to the
   wire dtype for casts, kept in fp32 for block codecs (encoded per part in phase 3). Reduces run one at
   a time, in call order;
2. state check (for the reduces of the run state's key: DiLoCo's rounds): groupmates' state tags
   came with matchmaking; if they differ nothing is sent, peers holding the group's state retry
   without the others, and a peer that is behind takes the group's state (``StateReplaced``);
3. all-reduce: every peer owns one slice of the values, cut into parts (at codec blocks for block
   codecs). Every contributor sends a part's owner its payload of it, the owner sends each groupmate
   the *other* contributors' payloads, and every peer merges all of a part's payloads in group order
   itself (``Merge.of``, ``block_runner``): no peer takes a mean from an owner. Casts: merged in
   fp32, rounded to the wire dtype (the bits the butterfly's owner sent back); block codecs: never
   re-quantized. Every participant holds the very same bits. With 3 or more peers, every member
   then sends each groupmate the digests of its own payloads and of those it relayed
   (``relay_check``): a payload not its sender's fails the round, blaming the owner that relayed it;
4. confirm: every peer sends (ok, digest of its result) to every groupmate. It commits only if all
   groupmates reported ok with its own digest; a lost peer or a partial all-reduce (hivemind fills a
   dead reducer's slice with local values) fails the attempt on every survivor, and the round is
   retried among the survivors until ``averaging_timeout + 4 * matchmaking_time`` has passed; after
   a failed attempt a peer never falls back to averaging alone (the others may regroup or give
   up). A peer that failed sends, instead of its digest, the groupmates it saw fail; a peer most
   reports blame (``blame``) is benched and not waited for: the retry and the rounds after go on
   without it, one line names it; a peer that saw every groupmate fail waits for their reports and,
   where most of them blame it, averages alone while benched;
5. on commit the mean is copied into the caller's tensors and the state tag advances; otherwise they
   are untouched and ``TransportError`` is raised, so DiLoCo keeps its state and the caller may retry.

Exact guarantee, casts: the result is ``to_wire(sum_in_group_order(to_wire(x_i)) / n)`` widened to
fp32 (for fp32 the rounding is the identity), bit-identical on every contributor. Against
``diloco_core.reference_mean`` it differs by the final rounding to the wire dtype (at most half
an ulp of the wire dtype) and, for 3 or more peers, by fp32 summation order. Block codecs: the result
is ``sum_in_group_order(decode(encode(x_i))) / n`` in fp32, never rounded again, bit-identical on every
contributor: ``reference_mean`` of the contributions in group order, exactly (so for 2 peers in any
order). Bytes sent per peer, counted as they go (payload bytes, not framing): for 2 peers one whole
payload of its values, like the butterfly (int8 0.254x, int4 0.129x of fp32 at block 256); for n
peers n - 1 payloads, casts too (the butterfly's was about 2(n - 1)/n). Alone, a peer gets its own
values as they travel (``decode(encode(x))``).

``broadcast`` has no source rank: the run's first peer (started without ``initial_peers``) keeps its
values, a joining peer downloads them from any peer that already holds them (``src`` must be 0,
meaning "whoever holds the run's state"). Peers serve a snapshot taken at each broadcast and at the
start of each all-reduce and after each round, plus the run state ``DiLoCo`` hands to
``HivemindTransport.attach`` (``diloco_core.RunState``: outer momentum and round, opaque here; loaded
on joining and, by the caller's wait, when a round finds this peer behind its group). With overlap the
run state also holds the completed means in flight: a snapshot is then also taken after each completed
reduce (its tag counts it), in a thread of its own, under ``RunState.lock``.

Only peers that know the run's secret can take part (``auth``): a slow KDF (scrypt) derives the run's
namespace and a MAC key from it; every DHT request and response (``dht_auth``: a non-member is neither
served nor routed through), the run's DHT records, matchmaking requests and confirmations carry HMACs,
and state is served only to peers whose presence record is MACed (docs/wan.md, "Authentication and
threat model"). The secret comes from a file, an environment variable or the config (``secret``), never
from argv where the trainer can help it; a first peer without one generates one (``join_settings``). Nothing received is unpickled (protobuf and msgpack only) and every
received tensor is checked for shape, dtype and finite values before use (a block codec's payloads
with ``codec.check``: shape, dtype, finite non-negative scales).

One concept per module: ``config`` (HivemindConfig), ``transport`` (HivemindTransport), ``attempts`` (a
reduce's attempts: whom and how long it waits, retries), ``attempt`` (one attempt, phases 1 and
5), ``grace`` (a quorum's grace windows), ``swarm`` (presence: whom a reduce waits for, a joiner's phase),
``averager`` (phases 2 and 4), ``averager_pool`` (a peer's averagers, one per key, size, codec and
merge), ``admission`` (whom an averager lets join or download), ``confirm`` (phase 4), ``relay_check`` (relayed payloads against
their senders' digests), ``blame`` (whom a failed exchange blames:
the retry goes without it), ``strikes`` (benches), ``reducer`` (phase 3), ``block_runner`` (phase 3 for block codecs),
``state_tag`` (the state tag and the stale verdict), ``tracked_state`` (a peer's tag, its download at a join, catching up, re-sync),
``state_server`` (state for joiners), ``donors`` (what each donor serves, a download from one),
``donor_choice`` (which served state a peer takes), ``checks`` (received tensors), ``handle`` (what all_reduce
returns), ``deadlines`` (every deadline of a reduce, from two settings), ``resources`` (processes, close), ``faults`` (HivemindFaults, for tests), ``requirement``
(the install hint when hivemind is missing), ``auth`` (keys from the secret, the records' MACs),
``dht_auth`` (the DHT for members only), ``secret`` (where the secret comes from), ``throttle`` (warnings
about requests anyone can repeat).
"""

from .faults import HivemindFaults
from .hivemind_config import HivemindConfig
from .requirement import import_hivemind

import_hivemind()  # before the modules below import hivemind: a missing one says how to install it

from .hivemind_transport import HivemindTransport

__all__ = ["HivemindConfig", "HivemindFaults", "HivemindTransport"]
