"""Model definitions: a byte-level GPT with named size presets."""

from diloco_swarm.models.gpt import GPT, PRESETS, GPTConfig, build_model, num_parameters

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "num_parameters"]
