"""`python -m tokenyard.worker …` is `tokenyard worker …`."""

from __future__ import annotations

import sys

from tokenyard.cli import app

if __name__ == "__main__":
    app(["worker", *sys.argv[1:]], prog_name="python -m tokenyard.worker")
