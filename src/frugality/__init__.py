"""frugality: train and run transformer models at the lowest cost, time and energy."""

__version__ = "0.1.0"
