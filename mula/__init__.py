"""Mula: Lightning recipes for pretraining dense and Mixture-of-Experts language models.

Kept light on purpose: importing `mula` pulls in torch only (no Lightning, no transformers).
"""

from mula.config import MulaConfig
from mula.model import Mula, MulaOutput

__all__ = ["Mula", "MulaConfig", "MulaOutput"]
