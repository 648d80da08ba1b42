"""``python -m tlm ...`` runs the ``tlm`` command, as ``torchrun -m tlm train ...`` does on every rank."""

import sys

from tlm_command.main import main

sys.exit(main())
