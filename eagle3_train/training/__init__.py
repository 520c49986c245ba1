"""The trainer: data sources, the objective, DeepSpeed wrapping, online training."""
