"""The attention transports, one file each, and their plugin registry (:mod:`.registry`:
entry-point group ``cp_core.transports``, the transport protocol, what a transport receives)."""
