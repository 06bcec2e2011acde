"""The short table every benchmark prints last (rich, right-aligned, wide enough for the columns)."""

from __future__ import annotations


def print_table(title: str, headers: list[str], cells: list[list[str]], width: int = 200) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for row in cells:
        table.add_row(*row)
    Console(width=width).print(table)
