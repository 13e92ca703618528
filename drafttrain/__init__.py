"""drafttrain: train speculative-decoding drafters and measure them."""
__version__ = "0.1.0"
