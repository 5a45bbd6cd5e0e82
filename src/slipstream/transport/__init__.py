"""Between processes: rollouts (orchestrator -> trainer), whole-run checkpoints and tenant registration. The
weight path (trainer -> inference) is slipstream.weights."""
