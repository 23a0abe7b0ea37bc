"""``python -m lonnymq.cli``, as ``python -m lonnymq``."""

import sys

from .arguments import main

sys.exit(main())
