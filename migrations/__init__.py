"""Alembic environment and versions: the only way seerd's schema changes.

Imported as `seerd.migrations` (seerd/migrations is a symlink to this directory), never as a
top-level `migrations`; Alembic itself loads env.py and versions/ by path."""
