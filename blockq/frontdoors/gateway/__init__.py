"""The OpenAI-compatible HTTP gateway (aiohttp): ``blockq gateway`` or
``python -m blockq.frontdoors.gateway``. See :mod:`blockq.frontdoors.gateway.server` for routes and errors."""

from blockq.frontdoors.gateway.config import GatewayConfig, gateway_config_from_env

__all__ = ["GatewayConfig", "gateway_config_from_env"]
