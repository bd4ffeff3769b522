# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""The host's random number streams (Python, NumPy, torch CPU) as one state.

A resumed run continues the streams that its checkpoint restored. Work done only because the
process is new (building the data iterators: each ``torch.utils.data`` iterator draws its base
seed from the CPU generator) must leave them as it found them, or the resumed run consumes draws
that the run that never stopped did not.
"""

import random

import numpy as np
import torch


def get_host_rng_state():
    """The Python, NumPy and torch CPU generator states."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_host_rng_state(state):
    """Restore a state of :func:`get_host_rng_state`."""
    python_state, numpy_state, torch_state = state
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
