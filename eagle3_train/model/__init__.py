"""The EAGLE-3 draft head (math only)."""

from eagle3_train.model.draft import DraftConfig, Eagle3Draft

__all__ = ["DraftConfig", "Eagle3Draft"]
