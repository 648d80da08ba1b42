"""``python -m tlm_model``: the ``tlm`` command."""

import sys

from tlm_model.cli import main

if __name__ == "__main__":
    sys.exit(main())
