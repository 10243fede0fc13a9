"""The built-in attention transports, one file each."""
