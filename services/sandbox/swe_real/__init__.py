"""SWE tasks from real repositories: small pure-Python projects from their sdists, a bug injected
by an AST mutation, verified against the project's own pytest suite (docs/environments.md,
"swe-real")."""
