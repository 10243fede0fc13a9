"""Collectives (with their counter), the CP mesh, rank failures and per-thread stacks: the bottom stage."""
