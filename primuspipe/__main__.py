"""``python -m primuspipe``: the ``primuspipe`` command, for an environment whose scripts directory is not on
``PATH`` (a virtual environment not activated, a ``PYTHONPATH`` checkout). Importing the module runs nothing
(tools that walk the package import every module)."""

import sys

from primuspipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
