"""Errors the engine raises at a request, in a module of their own: the scheduler process raises
them too, and must not import pydantic (srv.engine.params) on its way to torch."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the caller must change: a 400 naming the field (`param`) when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
