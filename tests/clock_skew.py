"""``diloco`` with each torchrun rank's clock a second apart from the others' (``time.strftime`` gets the rank
appended): what ranks that start in different seconds see when they make up a run name from the time."""

import os
import sys
import time

_strftime = time.strftime


def _skewed(fmt: str, *args: object) -> str:
    return _strftime(fmt, *args) + f"-{os.environ.get('RANK', '0')}"


time.strftime = _skewed  # type: ignore[assignment]

from diloco_train.cli import main  # after the clock is skewed

sys.exit(main())
