import sys

from tlm_train.cli import main

sys.exit(main())
