"""Lightning callbacks for Mula runs; recipes name them by `class_path` (e.g. `callbacks.Throughput`)."""

from callbacks.throughput import Throughput

__all__ = ["Throughput"]
