"""What hsx offers people: the CLI, verify, estimate, the demo, the CPU reference server, tiny models."""
