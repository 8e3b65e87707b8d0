"""Tool manifests and argument validation."""
