"""Frozen, versioned pydantic models of every JSON document Bulletin writes."""
