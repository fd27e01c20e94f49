"""Tenants and API keys kept in the broker, shared by every gateway."""
