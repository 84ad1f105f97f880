"""Cascadia: plan, simulate and run huge mixture-of-experts models on fleets of ordinary PCs."""

import os

# The engine's own numpy work between OpenVINO calls is small (norms, routing, one stream's attention), and a BLAS
# thread pool beside OpenVINO's competes with it for the cores: a decode step of bench/engine.py's model took 6-43%
# longer at 1 stream, 39-52% at 32, with OpenBLAS on both of 2 cores. Set before numpy loads (the command line
# imports this first); a value of the user's own wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
