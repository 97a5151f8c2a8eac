"""``python -m trillm.engine.core <EngineArgs JSON>``: the engine process (`_process.main`)."""

import sys

from ._process import main

sys.exit(main(sys.argv))
