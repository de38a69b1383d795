"""The OpenAI-compatible HTTP API, shared by the engine server and the gateway (each supplies a Backend)."""
