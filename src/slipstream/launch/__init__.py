"""Launching: plan the processes of a run (pure), then start and supervise them locally or on Slurm."""
