"""What every service process shares: running an asyncio service until a signal, JSON
logging, and serving a Prometheus registry."""
