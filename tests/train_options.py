"""TrainConfig's sections built from options named by field alone, for tests that build a config
rather than composing one."""

from typing import Any

from eagle3_train.core.errors import ConfigError
from eagle3_train.training.config import RENAMED, SECTIONS


def train_sections(**options: Any) -> dict[str, Any]:
    """TrainConfig's section arguments from options named by their field alone, for code that
    builds a config rather than composing one: ``train_sections(lr=1e-3,
    epochs=2)`` gives ``{"optim": OptimConfig(lr=1e-3), "loop": LoopConfig(epochs=2)}``."""
    by_section: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if f"train.{name}" not in RENAMED:
            raise ConfigError(f"{name} is no field of {', '.join(SECTIONS)}")
        by_section.setdefault(RENAMED[f"train.{name}"].split(".")[0], {})[name] = value
    return {section: SECTIONS[section](**values) for section, values in by_section.items()}
