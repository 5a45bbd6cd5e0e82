"""Metrics sinks and progress display shared by the processes."""
