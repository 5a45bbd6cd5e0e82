"""Model-agnostic parallelism for the trainer: process groups, device mesh, FSDP2 (+HSDP), activation checkpointing
and gradient clipping over sharded parameters. Applied to plain nn.Modules from outside; never imports models."""
