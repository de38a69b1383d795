"""Stand-ins that speak the API (no engine): a fake engine server for gateway tests and the gateway benchmark."""
