"""`python -m trillm.cli`: the `trillm` command, as the console script runs it."""

import sys

from ._command import main

sys.exit(main())
