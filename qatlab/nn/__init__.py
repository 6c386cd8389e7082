"""Layers and models: the dense Mlp with its buffers and losses (``mlp``)."""
from .mlp import (ACTIVATIONS, INITS, Gradients, Mlp, Scratch, _f32_2d, _labels, accuracy,
                  cross_entropy_loss, mse_loss)
