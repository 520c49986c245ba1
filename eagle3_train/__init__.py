"""eagle3_train: EAGLE-3 draft heads trained and served on the same hidden states."""

__version__ = "0.1.0"
