"""`kiln.torch`: the PyTorch frontend, `kiln.frontend.torch`, under its short name."""
import sys

from kiln.frontend import torch as _frontend

sys.modules[__name__] = _frontend
