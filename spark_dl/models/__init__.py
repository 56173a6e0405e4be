"""Networks of the thesis as plain ``torch.nn`` modules."""

from .cnn import ThesisCNN
from .fc import FCNet, build_model
from .rnn import CharLM, CharRNN, masked_cross_entropy, pad_sequences, sample, train_tbptt
from .srcnn import SRCNN
from .ssda import SSDA, THESIS_SSDA_LAYERS, DenoisingLayer, LayerSpec, kl_sparsity

__all__ = ["SRCNN", "SSDA", "THESIS_SSDA_LAYERS", "CharLM", "CharRNN", "DenoisingLayer", "FCNet",
           "LayerSpec", "ThesisCNN", "build_model", "kl_sparsity", "masked_cross_entropy",
           "pad_sequences", "sample", "train_tbptt"]
