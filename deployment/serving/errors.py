"""The server's refusals, shared by its frontends and backends; each message is one line."""


class BadRequest(ValueError):
    """A request the model refuses (ids out of range, non-finite values)."""


class UpdateRefused(ValueError):
    """An update that cannot be applied to the served version."""
