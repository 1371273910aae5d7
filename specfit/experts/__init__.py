"""Expert residency (the cache shared by the live decoder and the simulator) and expert predictors."""

from .cache import AdmitResult, ExpertCache

__all__ = ["ExpertCache", "AdmitResult"]
