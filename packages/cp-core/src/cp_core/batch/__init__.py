"""The caller's batch normalised, and the one document resolver with its sources."""
