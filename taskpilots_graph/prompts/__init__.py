"""Prompt templates and builders (resume and takeover prompts, English and Chinese)."""

from __future__ import annotations

__all__: list[str] = []
