"""retexo-fl: federated GNN training with lazy message passing (RETEXO) on Flower."""

__version__ = "0.1.0"
