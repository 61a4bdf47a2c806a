"""``python -m taskpilots_graph.cli``: the ``taskpilots`` command."""

from taskpilots_graph.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
