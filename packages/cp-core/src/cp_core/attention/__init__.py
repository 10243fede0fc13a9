"""SDPA interception and the CP attention transports."""
