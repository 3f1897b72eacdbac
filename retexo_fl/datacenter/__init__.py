"""Data-center mode: exact full-graph GCN training with CAGNET's 1D / 1.5D / 2D / 3D products."""
