"""qflowd's management HTTP API (JSON) and its Prometheus metrics: thin views
over the live broker, served with h11 on trio."""

from qflow.management.api import DEFAULT_PORT, DEFAULT_TIMEOUT, MAX_BODY, ManagementApi, ManagementServer

__all__ = ["DEFAULT_PORT", "DEFAULT_TIMEOUT", "MAX_BODY", "ManagementApi", "ManagementServer"]
