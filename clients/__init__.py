"""Flower ClientApp of retexo-fl."""
