"""Small helpers shared by all processes (filesystem, logging)."""
