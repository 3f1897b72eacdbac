"""Compression of what clients send: quantized boundary rows, bit allocation, schedules, model updates."""
