import os

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30)
settings.register_profile("thorough", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny models: one thread is faster than two (OpenMP spin-up dominates tiny kernels)
# and does not oversubscribe the 2-core CI machine.
torch.set_num_threads(1)
