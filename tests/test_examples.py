"""Each example of examples/ runs as docs/integrations.md says (2 workers, no downloads): both workers end
with the same global params (a digest of their bytes) after the last round, and the loss falls.

They need the ``integrations`` extra (transformers, accelerate, lightning), which ``dev`` installs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
LINE = re.compile(
    r"^worker (\d+): loss ([\d.]+) -> ([\d.]+), (\d+) rounds, global params ([0-9a-f]{16})$", re.MULTILINE
)


def test_the_integrations_doc_runs_every_example_and_only_those() -> None:
    doc = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    blocks = "\n".join(re.findall(r"```(?:sh|bash)\n(.*?)```", doc, flags=re.DOTALL))
    assert sorted(re.findall(r"^python examples/(\S+\.py)$", blocks, flags=re.MULTILINE)) == EXAMPLES
    assert EXAMPLES == ["accelerate_loop.py", "hf_trainer.py", "lightning_module.py"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", EXAMPLES)
def test_the_example_ends_with_identical_global_params_on_both_workers_and_a_falling_loss(example: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing may come from a hub
    out = subprocess.run(
        [sys.executable, f"examples/{example}"],  # the doc's command, from the repository's root
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    workers = LINE.findall(out.stdout)
    assert [int(w[0]) for w in workers] == [0, 1], out.stdout[-3000:] + out.stderr[-3000:]
    assert len({w[4] for w in workers}) == 1, f"the workers' global params differ: {workers}"
    for _, first, last, rounds, _ in workers:
        assert int(rounds) == 4
        assert float(last) < float(first) - 0.5, f"loss {first} -> {last}"
