"""wonderland_ds: the DeepSpeed engine for the Wonderland pipeline's stages 15-17."""

__version__ = "0.1.0"
