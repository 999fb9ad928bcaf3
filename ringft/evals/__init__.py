"""Evaluation helpers (line-retrieval test generation and scoring)."""
