"""Built-in environments. Each module registers its ids with ``@agentrl.env`` on import; the
``agentrl.envs`` entry points in pyproject.toml make them discoverable without an import."""
