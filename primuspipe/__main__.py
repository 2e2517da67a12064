"""``python -m primuspipe``: the ``primuspipe`` command, for an environment whose scripts directory is not on
``PATH`` (a virtual environment not activated, a ``PYTHONPATH`` checkout)."""

import sys

from primuspipe.cli import main

sys.exit(main())
