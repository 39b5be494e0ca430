"""Save and resharded-load throughput against torch DCP and the raw I/O roofline, in one run.

    python benches/reshard.py --size-gb 2 --json /tmp/reshard.json

Same as `olmo-chunks bench`; see `olmo_chunks.bench` and benches/README.md for what each column means.
"""

from __future__ import annotations

import sys

from olmo_chunks.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
