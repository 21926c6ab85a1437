"""Integrations with training frameworks. Each submodule imports its framework; this package does not."""
