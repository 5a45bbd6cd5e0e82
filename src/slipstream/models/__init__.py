"""Model families (plain nn.Modules), model acquisition (alias registry, GGUF import) and tiny test models."""
