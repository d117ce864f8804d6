"""Alembic environment and versions: the only way seerd's schema changes."""
