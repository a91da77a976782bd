"""A worker's memory for a model size: what its training holds, and what DiLoCo adds on each
transport and wire, from the scale benchmark's measurements (``bench/scale.py``, docs/results.md
"Scale"), not from a model of every buffer: the bytes per parameter (the slope of the peak between
5.1M and 20.0M parameters, 2 workers, AdamW, batch 2 x 64) and the fixed part (its intercept).

Checked at the ``150m`` preset (151.8M parameters, int4, batch 2 x 64, ``bench/preset_run.py``): a
hivemind peer predicted 9.00 GiB, measured 9.14 and 8.76 GiB (each peer's process tree); two gloo
workers predicted 12.11 GiB, measured 12.09 GiB (their tree, torchrun's agent in it).

Training alone measured 18.8 bytes per parameter (parameters 4, gradients 4, AdamW's moments 8, the
rest activations at that batch: a larger batch or sequence holds more) and 242 MiB. DiLoCo's part
lives where ``diloco.global_device`` puts it (the CPU by default, also on an accelerator), and a
hivemind peer's averagers are processes of their own on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEASURED", "TRAINING", "Memory", "memory"]

MIB = 2**20
TRAINING = (18.8, 242 * MIB)
"""Training without DiLoCo: (bytes per parameter, fixed bytes), measured at batch 2 x 64."""
MEASURED: dict[tuple[str, str], tuple[float, float]] = {
    ("torch", "fp32"): (12.8, 2 * MIB),
    ("torch", "int4"): (21.7, 96 * MIB),
    ("hivemind", "fp32"): (29.0, 496 * MIB),
    ("hivemind", "int4"): (39.1, 596 * MIB),
}
"""What DiLoCo adds per worker process, by (transport, wire): (bytes per parameter, fixed bytes)."""


@dataclass(frozen=True)
class Memory:
    """A worker's bytes: its training's, and what DiLoCo adds (None: not measured for the wire)."""

    training: float
    diloco: float | None

    @property
    def total(self) -> float | None:
        return None if self.diloco is None else self.training + self.diloco


def memory(params: int, *, transport: str, wire: str) -> Memory:
    """The memory of one worker training ``params`` parameters with DiLoCo on ``transport``,
    pseudo-gradients as ``wire`` (a codec name at its default settings)."""
    if params < 1:
        raise ValueError(f"params={params!r} is invalid: expected >= 1")
    per_param, fixed = TRAINING
    training = per_param * params + fixed
    measured = MEASURED.get((transport, wire))
    diloco = None if measured is None else measured[0] * params + measured[1]
    return Memory(training=training, diloco=diloco)
