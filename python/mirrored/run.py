"""``python -m mirrored.run``: the launcher, `mirrored-run` (``mirrored.tools.run``)."""

import sys

from .tools.run import main

if __name__ == "__main__":
    sys.exit(main())
