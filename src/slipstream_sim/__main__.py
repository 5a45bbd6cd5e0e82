"""`python -m slipstream_sim --port P --capacity C ...` runs the simulated inference server."""

import sys

from slipstream_sim.serve import main

sys.exit(main())
