"""``python -m diloco_train.cli``: the ``diloco`` command."""

import sys

from .main import main

sys.exit(main())
