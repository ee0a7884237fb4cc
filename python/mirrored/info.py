"""``python -m mirrored.info``: what this installation can do (``mirrored.tools.info``)."""

import sys

from .tools.info import main

if __name__ == "__main__":
    sys.exit(main())
