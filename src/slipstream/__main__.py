"""`python -m slipstream` is `slipstream`."""

import sys

from slipstream.cli import main

sys.exit(main())
