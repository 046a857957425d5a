"""``python -m thdpack.verify ...`` is ``thdpack verify ...``."""

import sys

from thdpack.verify.command import main

sys.exit(main())
