"""blockq: a predictive, Redis Streams based dispatcher for fleets of LLM inference engines."""

from blockq.client import AsyncClient, Client, Overloaded, SubmitSpec
from blockq.config import ConfigError, Settings
from blockq.wire.protocol import FinalRecord, ValidationError

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "ConfigError", "FinalRecord", "Overloaded", "Settings",
           "SubmitSpec", "ValidationError", "__version__"]
