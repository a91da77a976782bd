"""The README's library example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.timeout(90)
def test_library_example_runs_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 1, "the README has one Python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0], encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2"]  # 1000 steps, a round every 500
    assert all(line.endswith("agreement 1.00") for line in lines)  # one worker agrees with itself


@pytest.mark.timeout(60)
def test_codec_page_examples_are_valid_config() -> None:
    """docs/codecs.md's TOML table and Python line build the configs they show (docs cannot drift)."""
    import tomllib

    from diloco_core import DiLoCoConfig
    from diloco_train.run_config import build_config

    page = (README.parent / "docs" / "codecs.md").read_text(encoding="utf-8")
    (toml,) = re.findall(r"```toml\n(.*?)```", page, flags=re.DOTALL)
    diloco = tomllib.loads(toml)["diloco"]
    config = build_config(overrides=[f"diloco.{k}={str(v).lower()}" for k, v in diloco.items()])
    assert (config.diloco.codec, config.diloco.codec_block, config.diloco.error_feedback) == ("int8", 256, True)
    (python,) = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    scope: dict = {}
    exec(python, scope)  # noqa: S102 - our own doc's example
    assert isinstance(scope["config"], DiLoCoConfig) and scope["config"].codec == "int4"
