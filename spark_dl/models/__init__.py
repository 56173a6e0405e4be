"""Networks as plain ``torch.nn`` modules: the thesis's, and the ResNet and transformer users
bring; ``build_model`` builds the zoo's by name (spark_dl.models.zoo)."""

from .cnn import ThesisCNN
from .fc import FCNet
from .resnet import ResNet18
from .rnn import CharLM, CharRNN, masked_cross_entropy, pad_sequences, sample, train_tbptt
from .srcnn import SRCNN
from .ssda import SSDA, THESIS_SSDA_LAYERS, DenoisingLayer, LayerSpec, kl_sparsity
from .transformer import TransformerLM
from .zoo import MODELS, build_model

__all__ = ["MODELS", "SRCNN", "SSDA", "THESIS_SSDA_LAYERS", "CharLM", "CharRNN", "DenoisingLayer",
           "FCNet", "LayerSpec", "ResNet18", "ThesisCNN", "TransformerLM", "build_model", "kl_sparsity", "masked_cross_entropy",
           "pad_sequences", "sample", "train_tbptt"]
