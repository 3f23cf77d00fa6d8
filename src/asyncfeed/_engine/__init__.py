"""The engine: the loader, its index plan, the pass's pipeline and runtime, sample layouts, statistics."""
