"""``python -m stitch_backend.bench [FILE...] [--kernelbench DIR --level N] ...``: the bench alone."""

import sys

from .cli import main

sys.exit(main())
