"""Orchestrator: samples tasks, drives rollouts against inference, scores them and writes training batches."""
