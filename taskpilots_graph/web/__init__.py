"""The takeover inbox in the browser (optional extra ``web``).

``taskpilots inbox --db runs.db --graph myapp.agent:make_graph`` serves it on
``http://127.0.0.1:8765``; :func:`create_app` builds the Starlette app for any other server.
"""

from __future__ import annotations

from taskpilots_graph.web.app import create_app
from taskpilots_graph.web.security import InsecureBind, check_bind, is_loopback

__all__ = ["InsecureBind", "check_bind", "create_app", "is_loopback"]
