"""Networks of the thesis as plain ``torch.nn`` modules."""

from .cnn import ThesisCNN
from .fc import FCNet, build_model

__all__ = ["FCNet", "ThesisCNN", "build_model"]
