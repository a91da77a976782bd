"""DiLoCo under Hugging Face's Trainer: a tiny Llama, 2 workers (threads) averaging every 10 steps.

Run: python examples/hf_trainer.py. The Trainer calls optimizer.step() itself; DiLoCoOptimizer runs an
outer round after every inner_steps-th step. Workers in processes of their own (other machines): see
docs/integrations.md ("One worker per process").
"""

import hashlib
import pathlib
import sys
import tempfile
import threading

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from diloco_core import DiLoCo, DiLoCoConfig, DiLoCoOptimizer
from transports import create_transport

WORKERS, INNER_STEPS, STEPS, SEQ = 2, 10, 40, 32
TEXT = torch.tensor(list(pathlib.Path(threading.__file__).read_bytes()))  # bytes of a stdlib module: no download


def samples(rank: int) -> list[dict]:  # each worker its own slice of the text
    starts = range(rank * 8000, rank * 8000 + 8000, 25)
    return [{"input_ids": TEXT[s : s + SEQ], "labels": TEXT[s : s + SEQ]} for s in starts]


def worker(rank: int, out: dict) -> None:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    spec = {"kind": "inprocess", "world_size": WORKERS, "rank": rank, "group": "hf"}
    with create_transport(spec) as transport, tempfile.TemporaryDirectory() as output_dir:
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        optimizer = DiLoCoOptimizer(DiLoCo(model, inner, transport, DiLoCoConfig(inner_steps=INNER_STEPS)))
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=STEPS,
            per_device_train_batch_size=8,
            logging_steps=INNER_STEPS,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=samples(rank), optimizers=(optimizer, None))
        trainer.train()
    out[rank] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], optimizer.diloco


if __name__ == "__main__":
    out: dict = {}
    threads = [threading.Thread(target=worker, args=(rank, out)) for rank in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(out) < WORKERS:  # a worker's thread raised: its traceback is above
        sys.exit(f"{WORKERS - len(out)} of {WORKERS} workers failed")
    for rank, (losses, diloco) in sorted(out.items()):
        digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in diloco.global_params)).hexdigest()[:16]
        print(f"worker {rank}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {diloco.round} rounds, global params {digest}")
