"""Data planes between processes: rollouts (orchestrator -> trainer) and weights (trainer -> inference)."""
