"""Prompt templates and builders: the resume prompt, in English and Chinese."""

from __future__ import annotations

from taskpilots_graph.prompts.resume import (
    DEFAULT_MAX_CHARS,
    ResumeFacts,
    build_resume_prompt,
    resume_facts,
)
from taskpilots_graph.prompts.templates import TEMPLATES, Language

__all__ = [
    "DEFAULT_MAX_CHARS",
    "TEMPLATES",
    "Language",
    "ResumeFacts",
    "build_resume_prompt",
    "resume_facts",
]
