"""Code that uses only multiserve's public API (or none of it): benchmark peers, clients.

Never imported by `multiserve/` itself (docs/architecture.md §2)."""
