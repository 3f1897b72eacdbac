"""Stage models and the standard GNN reference."""
