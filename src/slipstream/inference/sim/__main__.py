"""`python -m slipstream.inference.sim --port P --capacity C ...` runs the simulated inference server."""

import sys

from slipstream.inference.sim.serve import main

sys.exit(main())
