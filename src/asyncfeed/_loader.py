"""Placeholder while the loader core is written (replaced in the next commit)."""


class AsyncLoader:  # pragma: no cover - replaced
    def __init__(self, *a, **k):
        raise NotImplementedError("AsyncLoader is being written")
