"""The model a run produced, out of its checkpoint: the global weights as safetensors, loadable without the run.

A checkpoint holds DiLoCo's global copy as one flat fp32 tensor in the order of its fragments, beside each
worker's own drifting replica; ``global_state`` takes the global copy apart into named tensors (in ddp and
single mode, and during diloco's DDP warm start, the model's own weights are the run's). ``export`` writes

- ``model.safetensors`` and ``config.json`` (the model config, the tokenizer, where they came from), which
  ``load`` turns back into a ``diloco_train.model.Llama``;
- ``hf/``: the same weights as a Hugging Face ``LlamaForCausalLM`` folder (``hf_llama``).

The weights are those the run's evals see (``evals``): an export of a finished run evaluates to its final
eval loss. Usage (docs/trainer.md, "The model you get")::

    from diloco_train.export import load
    model = load("runs/NAME/export")          # a Llama in eval mode, fp32, on the CPU
    logits = model(torch.tensor([list(b"import os")]))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from diloco_core.rules import from_mapping
from diloco_core.streaming import strided_fragments

from .data.corpus import DataConfig
from .hf_llama import write_hf
from .model import Llama, ModelConfig
from .run_config import load_toml
from .runs.checkpoint import load_checkpoint
from .runs.run_folder import RunFolder

__all__ = ["FORMAT", "Exported", "export", "global_state", "load"]

FORMAT = "diloco-llama-1"


@dataclass(frozen=True, kw_only=True)
class Exported:
    """What ``export`` wrote: the folder, the checkpoint's step and the run's configs."""

    out: Path
    step: int
    model: ModelConfig
    data: DataConfig
    tokenizer: str
    """Where the tokenizer is, in words."""


def _configs(run_dir: Path) -> tuple[ModelConfig, DataConfig, dict[str, Any]]:
    path = RunFolder(run_dir).config
    if not path.is_file():
        raise ValueError(
            f"{str(run_dir)!r} is not a run folder: it has no config.toml (e.g. runs/diloco-...)"
        )
    saved = load_toml(path)
    model = from_mapping(ModelConfig, saved.get("model", {}), "model").resolved()
    data = from_mapping(DataConfig, saved.get("data", {}), "data")
    return model, data, saved


def global_state(
    run_dir: str | Path, step: int | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """The run's global weights by parameter name at its checkpoint of ``step`` (None: the newest), and that step."""
    run_dir = Path(run_dir)
    model_config, _, saved = _configs(run_dir)
    shards = saved.get("train", {}).get("fsdp_shards", 1)
    if shards != 1:
        raise ValueError(
            f"train.fsdp_shards={shards}: each rank's checkpoint holds its shards of the model only; "
            "export supports runs of whole models (fsdp_shards=1)"
        )
    run = RunFolder(run_dir)
    ranks = run.checkpoint_ranks()
    steps = run.rank(ranks[0]).steps() if ranks else []
    if not steps:
        raise ValueError(f"run {str(run_dir)!r} has no checkpoint yet: nothing to export")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(
            f"--step {step} is invalid: expected one of the run's checkpoints, steps {steps}"
        )
    core = load_checkpoint(run.rank(ranks[0]).checkpoint(step))["core"]
    with torch.device("meta"):
        model = Llama(model_config)  # names, shapes and block structure; nothing allocated
    named = list(model.named_parameters())
    if "global" not in core:  # ddp, single, a DDP warm start: every replica holds the run's weights
        return step, {name: t.float() for (name, _), t in zip(named, core["model"], strict=True)}
    names = [name for name, _ in named]
    if list(core["param_names"]) != names:
        raise ValueError(
            f"the checkpoint's parameters do not match the run's [model] in {RunFolder(run_dir).config}"
        )
    # The global copy holds the fragments one after another (streaming: strided blocks; a list of guards);
    # the trainer never passes fragments of its own, so the core's strided split reproduces the order.
    guard = core["guard"]
    fragments = len(guard) if isinstance(guard, list) else 1
    params = [p for _, p in named]
    order = [i for group in strided_fragments(model, params, fragments) for i in group]
    flat: torch.Tensor = core["global"]
    if flat.numel() != sum(p.numel() for p in params):
        raise ValueError(
            f"the checkpoint's global copy has {flat.numel()} values, the run's model another count"
        )
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for i in order:
        n = params[i].numel()
        out[names[i]] = flat[offset : offset + n].view(params[i].shape).clone()
        offset += n
    return step, {name: out[name] for name in names}


def _tokenizer(data: DataConfig) -> dict[str, Any]:
    if data.hf_tokenizer:
        return {
            "kind": "hf",
            "name": data.hf_tokenizer,
            "how": "transformers.AutoTokenizer.from_pretrained(name)",
        }
    return {
        "kind": "bytes",
        "vocab_size": 256,
        "how": "token ids are the text's UTF-8 bytes: list(text.encode())",
    }


def export(
    run_dir: str | Path, out: str | Path | None = None, *, step: int | None = None
) -> Exported:
    """Write the run's global weights (its newest checkpoint, or ``step``'s) to ``out`` (default RUN/export):
    ours as model.safetensors + config.json, and Hugging Face's in ``out``/hf."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError(
            "diloco export writes safetensors: pip install safetensors (or 'diloco[train]')"
        ) from None

    run_dir = Path(run_dir)
    model_config, data, _ = _configs(run_dir)
    step, state = global_state(run_dir, step)
    folder = Path(out) if out is not None else run_dir / "export"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    meta = {
        "format": FORMAT,
        "model": asdict(model_config),
        "tokenizer": _tokenizer(data),
        "seq_len": data.seq_len,
        "run": str(run_dir),
        "step": step,
    }
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    write_hf(folder / "hf", model_config, state, max_positions=data.seq_len)
    words = (
        _copy_tokenizer(data.hf_tokenizer, folder / "hf")
        if data.hf_tokenizer
        else "bytes (token = a UTF-8 byte)"
    )
    return Exported(out=folder, step=step, model=model_config, data=data, tokenizer=words)


def _copy_tokenizer(name: str, folder: Path) -> str:
    """Save the run's Hugging Face tokenizer beside the HF weights, so that ``from_pretrained(folder)`` finds both;
    where it cannot be loaded here (no transformers, offline), say so: the weights do not depend on it."""
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(name).save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - any failure leaves the export whole; the user gets why in one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{name!r}, not copied to hf/ ({reason})"
    return f"{name!r}, copied to hf/"


def load(folder: str | Path, *, device: str | torch.device = "cpu") -> Llama:
    """The ``Llama`` that ``export`` wrote to ``folder``, in eval mode."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        meta = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(folder)!r} is not a diloco export: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{str(folder)!r} is not a diloco export: config.json's format is not {FORMAT!r}"
        )
    with torch.device("meta"):  # no initialisation: every weight comes from the file
        model = Llama(from_mapping(ModelConfig, meta["model"], "model"))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), assign=True)
    return model.to(device).eval()
