"""Layers and models: the dense Mlp with its buffers and losses (``mlp``), the conv/pool/dense layers
(``layers``) and the convolutional model (``cnn``)."""
from .mlp import (ACTIVATIONS, INITS, Gradients, Mlp, Scratch, as_f32_2d, as_labels, accuracy,
                  cross_entropy_loss, mse_loss)
from .layers import Conv2d, Flatten, Linear, MaxPool2d
from .cnn import Cnn, CnnGradients, CnnScratch, conv_plan
