"""Flower ServerApp of retexo-fl."""
