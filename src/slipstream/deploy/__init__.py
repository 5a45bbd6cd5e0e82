"""Cluster deployments rendered from a run's config (Kubernetes manifests)."""
