"""retexo-fl: federated GNN training with lazy message passing (RETEXO) on Flower."""

import warnings

__version__ = "0.1.0"

# PyG's import scripts a few helpers with torch.jit.script, which this torch deprecates: every
# process that loads a graph or builds a model (each simulated or deployed ClientApp among them)
# printed it, and nobody running retexo-fl can act on it. Only that message is silenced.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)
