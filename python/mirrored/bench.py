"""``python -m mirrored.bench``: the nccl-tests-style benchmark CLI (``mirrored.tools.bench``)."""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
