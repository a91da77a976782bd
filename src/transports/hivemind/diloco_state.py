"""DiLoCo's outer state for joiners (through DiLoCo's public API only): the outer momentum and round that
``HivemindTransport.attach`` serves to joiners, loads on joining and reloads when a round finds this peer
behind its group. ``transport`` is the ``HivemindTransport``.

An adapter kept apart on purpose: a public core API for a worker's outer state will replace it.
"""

import logging
from collections.abc import Callable
from typing import Any

import torch

from diloco_core.transport import TransportError

from .checks import check_tensor

logger = logging.getLogger(__name__)


def share_diloco_state(transport: Any, diloco: Any) -> None:
    """Serve ``diloco``'s outer momentum and round to joiners (the global params travel by broadcast),
    and let the transport re-sync ``diloco`` when a round finds it behind its group (``track_state``).

    The snapshot joiners download is refreshed right after every outer step (a torch optimizer
    post-hook), so a joiner gets the round that just finished, not the one before it."""

    stepped = [0]  # 1 while the outer step has run but DiLoCo has not yet counted the round

    def get_state() -> tuple[dict, list[torch.Tensor]]:
        state = diloco.state_dict()
        buffers = [
            s["momentum_buffer"]
            for s in state["outer_optimizer"]["state"].values()
            if s.get("momentum_buffer") is not None
        ]
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
    transport.track_state(
        diloco.reduce_numel, diloco.config.wire_dtype, lambda meta, tensors: outer_state_loader(diloco, meta, tensors)
    )


def load_diloco_state(transport: Any, diloco: Any, timeout: float) -> bool:
    """On a joiner, take the outer momentum and round the peers shared; False on the swarm's first peer."""
    got = transport.load_state(timeout)
    if got is None:
        return False
    meta, tensors = got
    if not meta:
        logger.warning("the peers shared no DiLoCo state (they broadcast without a DiLoCo): keeping round and momentum")
        return False
    outer_state_loader(diloco, meta, tensors)()
    transport.adopt_downloaded_tag()  # and serve what was just loaded, not the state from before it
    return True


def outer_state_loader(diloco: Any, meta: dict, tensors: list[torch.Tensor]) -> Callable[[], None]:
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
            check_tensor(t, shape=like.shape, dtype=torch.float32, what="outer momentum")
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
