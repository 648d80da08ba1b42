"""``python -m tlm_tokenizer tokenizer train|encode ...``, for use without tlm-model's ``tlm`` command."""

import sys

from tlm_tokenizer.cli import main

sys.exit(main())
