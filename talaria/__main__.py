"""`python -m talaria`: the `talaria` command, for an environment whose scripts folder is not on PATH."""

import sys

from talaria.cli import main

sys.exit(main())
