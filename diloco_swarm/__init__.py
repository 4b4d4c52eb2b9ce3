"""diloco-swarm: peer-to-peer DiLoCo training over hivemind."""

import warnings

# hivemind decorates functions with @torch.jit.script at import; newer torch warns about it
# (FutureWarning or DeprecationWarning, by version) before every command's own output. Only that one.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", module=r"torch\.jit")

__version__ = "0.1.0"
