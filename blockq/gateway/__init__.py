"""The OpenAI-compatible HTTP gateway (aiohttp): ``blockq gateway`` or
``python -m blockq.gateway``. See :mod:`blockq.gateway.server` for routes and errors."""

from blockq.gateway.config import GatewayConfig, gateway_config_from_env

__all__ = ["GatewayConfig", "gateway_config_from_env"]
