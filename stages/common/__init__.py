"""Helpers shared by the stages: typed params, atomic writes, camera conventions, logging."""
